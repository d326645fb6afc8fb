"""Test accuracy of `fashion_mnist_cnn` with compressed gradients against float32, at the same
steps: the full-length runs behind the shortened ones in tests/test_fashion_mnist.py.

    python -m experiments.bench.compression_accuracy [--steps 700] [--out bench_results]

On 8 simulated devices: float32, bfloat16 and PowerSGD ranks 1 and 4 (uncompressed for the
first 10% of the steps, as PyTorch advises); on 2 processes of 1 device (jddp-launch, gloo):
float32 and bfloat16. Each is one `python -m experiments.train` run of the same config.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from experiments.bench import common

VARIANTS = {
    "float32": {},
    "bfloat16": {"grad_comm_dtype": "bfloat16"},
    "powersgd1": {"grad_compression": "powersgd", "powersgd_rank": 1},
    "powersgd4": {"grad_compression": "powersgd", "powersgd_rank": 4},
}


def run(variant: str, steps: int, processes: int, workdir: str) -> dict:
    parallel = dict(VARIANTS[variant])
    if "grad_compression" in parallel:
        parallel["powersgd_start_step"] = steps // 10
    flags = [
        "--config=experiments/configs/fashion_mnist_cnn.py",
        f"--workdir={workdir}",
        f"--config.num_train_steps={steps}",
        f"--config.eval_every={steps}",
        "--config.checkpoint_every=0",
        *(f"--config.parallel.{key}={value}" for key, value in parallel.items()),
    ]
    train = [sys.executable, "-m", "experiments.train", *flags]
    env = dict(os.environ)
    if processes == 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        command = train
    else:
        launcher = [sys.executable, "-m", "jddp.runtime.launch", f"--nproc={processes}"]
        command = [*launcher, "--devices_per_proc=1", "--", *train]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=7200)
    if result.returncode:
        raise RuntimeError(f"{variant} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    return {
        "setting": "8 simulated devices" if processes == 1 else f"{processes} processes x 1 device",
        "variant": variant,
        "steps": steps,
        "eval_accuracy": summary["eval_accuracy"],
        "wall_sec": time.perf_counter() - start,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        plan = [(v, 1) for v in VARIANTS] + [("float32", 2), ("bfloat16", 2)]
        for variant, processes in plan:
            workdir = os.path.join(scratch, f"{variant}-{processes}")
            rows.append(run(variant, args.steps, processes, workdir))
            print(rows[-1], flush=True)
    for row in rows:
        base = next(r for r in rows if r["setting"] == row["setting"] and r["variant"] == "float32")
        row["points_vs_float32"] = 100 * (row["eval_accuracy"] - base["eval_accuracy"])
    common.report("compression_accuracy", rows, {"steps": args.steps}, args.out)


if __name__ == "__main__":
    main()
