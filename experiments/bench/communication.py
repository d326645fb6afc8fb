"""Compressed gradient communication: jddp's float32, bfloat16 and PowerSGD (ranks 1, 4, 16)
against PyTorch DDP with the same compressions as communication hooks.

    pip install -e ".[bench]"          # torch (a CPU wheel here) and matplotlib
    python -m experiments.bench.communication [--repeats 3] [--steps 20] [--out bench_results]

An MLP 1024-2048-2048-2048-10 (10.5M parameters: 42 MB of float32 gradients a step), Adam,
global batch 128 of synthetic data, in two settings:
- 2 processes x 1 CPU device over gloo, started by jddp-launch, process r pinned to core r
  (PyTorch: `torch.set_num_threads(1)`), both with the glibc malloc settings of
  jddp/runtime/host_memory.py (`multiprocess.launch`). One launch runs every variant of one
  framework: a warm-up, then `--steps` timed steps per variant, the variants' order reversed every
  other launch; jddp and PyTorch launches alternate; medians over `--repeats` launches. PyTorch DDP
  (gloo, default 25 MB buckets): no hook (float32), the body of `bf16_compress_hook` (its
  `_compress_hook(torch.bfloat16, ...)`: DDP refuses the named hook without CUDA and NCCL), and
  `powerSGD_hook` at the same ranks (error feedback, warm start, compression from iteration 2;
  one 64 MB bucket, see `torch_worker`).
- 8 simulated devices in one process (jddp only: PyTorch has no simulated devices), variants
  interleaved in timed windows.
Bytes per step and device use one convention (`jddp.observe.hlo.ring_bytes`: an all-reduce moves
twice its size): jddp's are read from its compiled HLO; PyTorch's are counted from what its hooks
send (float32 or bfloat16 buckets; PowerSGD's P and Q of the matrices its `_should_compress`
picks, plus the rest).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from experiments.bench.multiprocess import launch, pin_to_own_core, torch_join, torch_mlp

LAYERS = [1024, 2048, 2048, 2048, 10]
GLOBAL_BATCH, WARMUP = 128, 3
RANKS = (1, 4, 16)
VARIANTS = ["float32", "bfloat16", *(f"powersgd{r}" for r in RANKS)]


def synthetic_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "image": rng.normal(size=(GLOBAL_BATCH, LAYERS[0])).astype(np.float32),
        "label": rng.integers(0, 10, size=GLOBAL_BATCH).astype(np.int32),
    }


def process_rows(rank: int, processes: int) -> dict[str, np.ndarray]:
    rows = GLOBAL_BATCH // processes
    return {k: v[rank * rows : (rank + 1) * rows] for k, v in synthetic_batch().items()}


def jddp_options(variant: str) -> dict:
    if variant == "bfloat16":
        return {"grad_comm_dtype": "bfloat16"}
    if variant.startswith("powersgd"):
        return {"grad_compression": "powersgd", "powersgd_rank": int(variant[8:])}
    return {}


# --------------------------------------------------------------------------- workers
def jddp_runs(batch, order: list[str]) -> dict:
    """{variant: a warmed-up run}: its trainer, state, placed batch and bytes per step."""
    import jax
    import optax

    import jddp
    from jddp.models import MLP

    runs = {}
    for variant in order:
        trainer = jddp.Trainer(
            MLP(num_classes=LAYERS[-1], hidden_sizes=tuple(LAYERS[1:-1])),
            jddp.losses.softmax_cross_entropy,
            optax.adam(1e-3),
            log_grad_norm=False,
            **jddp_options(variant),
        )
        state = trainer.init(seed=0, sample_batch=batch)
        placed = trainer.place_batch(batch)
        comm = trainer.memory_report(state, placed)["comm_bytes_per_step"]
        for _ in range(WARMUP):
            state, _ = trainer.step(state, placed)
        jax.block_until_ready(state)
        runs[variant] = {"trainer": trainer, "state": state, "placed": placed, "bytes": comm}
    return runs


def jddp_window(run: dict, steps: int) -> float:
    """Seconds for `steps` more steps of `run` (its state advances)."""
    import jax

    start = time.perf_counter()
    for _ in range(steps):
        run["state"], _ = run["trainer"].step(run["state"], run["placed"])
    jax.block_until_ready(run["state"])
    return time.perf_counter() - start


def jddp_worker(order: list[str], steps: int) -> dict:
    pin_to_own_core()
    from jddp.runtime import processes as runtime

    runtime.initialize()
    import jax

    runs = jddp_runs(process_rows(jax.process_index(), jax.process_count()), order)
    return {v: {"sec": jddp_window(runs[v], steps), "bytes": runs[v]["bytes"]} for v in order}


def torch_hook(variant: str, model):
    """Registers the communication hook of `variant` on a DDP `model`; returns the bytes per
    step and device its all-reduces move (ring convention: twice the buffers' size)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    sizes = [p.numel() for p in model.parameters()]
    if variant == "float32":
        return 2 * 4 * sum(sizes)
    if variant == "bfloat16":
        import torch

        def bf16_compress(state, bucket):  # bf16_compress_hook's own body
            return default_hooks._compress_hook(torch.bfloat16, state, bucket)

        model.register_comm_hook(None, bf16_compress)
        return 2 * 2 * sum(sizes)
    rank = int(variant[8:])
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2
    )
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    values = 0
    for p in model.parameters():
        matrix = p.view(p.shape[0], -1) if p.ndim > 1 else None
        if matrix is None:
            values += p.numel()
            continue
        n, m = matrix.shape
        r = min(n, m, rank)
        compress, whole, compressed = powerSGD_hook._should_compress(n, m, r, 2)
        values += compressed if compress else whole
    return 2 * 4 * values


def torch_worker(order: list[str], steps: int) -> dict:
    rank, world = torch_join()
    import torch
    import torch.distributed as dist

    batch = process_rows(rank, world)
    x, y = torch.from_numpy(batch["image"]), torch.from_numpy(batch["label"]).long()
    loss_fn = torch.nn.CrossEntropyLoss()
    runs = {}
    for variant in order:
        # PowerSGD issues its P and Q all-reduces from future callbacks: with several buckets
        # their order can differ between the ranks and gloo fails ("Received data size doesn't
        # match expected size"), so PowerSGD gets one bucket of every gradient.
        bucket_mb = 64 if variant.startswith("powersgd") else 25  # 25: DDP's default
        model = torch.nn.parallel.DistributedDataParallel(
            torch_mlp(LAYERS), bucket_cap_mb=bucket_mb
        )
        comm = torch_hook(variant, model)
        runs[variant] = (model, torch.optim.Adam(model.parameters(), lr=1e-3), comm)

    def step(model, optimizer):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()  # DDP reduces the gradient buckets in backward
        optimizer.step()

    for variant in order:
        for _ in range(WARMUP):
            step(*runs[variant][:2])
    results = {}
    for variant in order:
        model, optimizer, comm = runs[variant]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step(model, optimizer)
        dist.barrier()
        results[variant] = {"sec": time.perf_counter() - start, "bytes": comm}
    dist.destroy_process_group()
    return results


def simulated_worker(order: list[str], steps: int, repeats: int) -> dict:
    """8 simulated devices in this process: every variant's windows interleaved."""
    import jax

    from experiments.bench import common

    assert jax.device_count() == 8
    runs = jddp_runs(synthetic_batch(), order)
    windows = {v: (lambda run=runs[v]: jddp_window(run, steps)) for v in order}
    timings = common.interleaved_medians(windows, repeats)
    return {v: {"all_sec": timings[v]["all_sec"], "bytes": runs[v]["bytes"]} for v in order}


# --------------------------------------------------------------------------- parent
def two_processes(repeats: int, steps: int) -> dict:
    times = {(f, v): [] for f in ("jddp", "torch") for v in VARIANTS}
    byte_counts = {}
    for round_index in range(repeats):
        order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
        frameworks = ("jddp", "torch") if round_index % 2 == 0 else ("torch", "jddp")
        for framework in frameworks:
            args = [f"--worker={framework}", f"--steps={steps}", f"--order={','.join(order)}"]
            result = json.loads(launch(args, module="experiments.bench.communication"))
            for variant, run in result.items():
                times[(framework, variant)].append(run["sec"])
                byte_counts[(framework, variant)] = run["bytes"]
            print(f"round {round_index + 1}/{repeats}: {framework} done", flush=True)
    return {"times": times, "bytes": byte_counts}


def eight_devices(repeats: int, steps: int) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    command = [
        sys.executable,
        "-m",
        "experiments.bench.communication",
        "--worker=simulated",
        f"--steps={steps}",
        f"--repeats={repeats}",
        f"--order={','.join(VARIANTS)}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"8-device run failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({row["setting"] for row in rows})
    figure, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.2), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        for framework, marker in (("jddp", "o"), ("PyTorch DDP", "s")):
            points = [r for r in rows if r["setting"] == setting and r["framework"] == framework]
            if not points:
                continue
            ax.scatter(
                [p["bytes_per_step"] for p in points],
                [p["examples_per_sec"] for p in points],
                marker=marker,
                label=framework,
            )
            for p in points:
                ax.annotate(p["variant"], (p["bytes_per_step"], p["examples_per_sec"]), fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("collective bytes per step and device")
        ax.set_ylabel("examples/s")
        ax.set_title(setting)
        ax.grid(True, alpha=0.3)
        ax.legend()
    figure.suptitle("MLP 10.5M parameters, Adam: gradient communication")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--skip_simulated", action="store_true")
    parser.add_argument("--worker", choices=["jddp", "torch", "simulated"], help=argparse.SUPPRESS)
    parser.add_argument("--order", default=",".join(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    order = args.order.split(",")
    if args.worker == "simulated":
        print("RESULT " + json.dumps(simulated_worker(order, args.steps, args.repeats)), flush=True)
        return
    if args.worker:
        worker = jddp_worker if args.worker == "jddp" else torch_worker
        print("RESULT " + json.dumps(worker(order, args.steps)), flush=True)
        return

    from experiments.bench import common

    common.check_output_folder(args.out)

    examples = GLOBAL_BATCH * args.steps
    rows, extra = [], {"repeats": args.repeats, "steps": args.steps}
    measured = two_processes(args.repeats, args.steps)
    for variant in VARIANTS:
        for framework, name in (("jddp", "jddp"), ("torch", "PyTorch DDP")):
            times = measured["times"][(framework, variant)]
            rows.append(
                {
                    "setting": "2 processes x 1 device (gloo)",
                    "framework": name,
                    "variant": variant,
                    "examples_per_sec": examples / statistics.median(times),
                    "bytes_per_step": measured["bytes"][(framework, variant)],
                }
            )
        jddp_sec, torch_sec = (measured["times"][(f, variant)] for f in ("jddp", "torch"))
        paired = zip(jddp_sec, torch_sec, strict=True)
        extra[f"jddp_over_torch_{variant}"] = statistics.median(t / j for j, t in paired)
    extra["all_sec_2proc"] = json.dumps({f"{f}/{v}": t for (f, v), t in measured["times"].items()})
    if not args.skip_simulated:
        simulated = eight_devices(args.repeats, args.steps)
        for variant in VARIANTS:
            rows.append(
                {
                    "setting": "8 simulated devices, 1 process",
                    "framework": "jddp",
                    "variant": variant,
                    "examples_per_sec": examples / statistics.median(simulated[variant]["all_sec"]),
                    "bytes_per_step": simulated[variant]["bytes"],
                }
            )
        extra["all_sec_8dev"] = json.dumps({v: s["all_sec"] for v, s in simulated.items()})
    jddp_bytes = {r["variant"]: r["bytes_per_step"] for r in rows if r["framework"] == "jddp"}
    extra["powersgd4_bytes_over_float32"] = jddp_bytes["powersgd4"] / jddp_bytes["float32"]
    common.report("communication", rows, extra, args.out)
    picture = os.path.join(args.out, "communication.png")
    plot(rows, picture)
    print(f"wrote {picture}")


if __name__ == "__main__":
    main()
