"""jddp DDP across 2 processes against PyTorch DDP, both with gloo on this machine's CPU.

    pip install torch==2.13.0        # the optional benchmark dependency (a CPU wheel here)
    python -m experiments.bench.multiprocess [--repeats 5] [--steps 60] [--out bench_results]

The same MLP 784-1024-1024-10, Adam, float32, global batch 256 of synthetic data split over 2
processes of one device each, started by jddp-launch. The same thread budget: process r of either
framework is pinned to core r (and PyTorch told to use 1 thread). A run = one launch timing
`--steps` steps after warm-up; jddp and PyTorch runs alternate (interleaved), medians compared.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

LAYERS = [784, 1024, 1024, 10]
GLOBAL_BATCH, WARMUP = 256, 10


def synthetic_batch(rank: int, processes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.normal(size=(GLOBAL_BATCH, LAYERS[0])).astype(np.float32),
        "label": rng.integers(0, 10, size=GLOBAL_BATCH).astype(np.int64),
    }
    rows = GLOBAL_BATCH // processes
    return {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}


def pin_to_own_core() -> int:
    rank = int(os.environ["JDDP_PROCESS_ID"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    return rank


# --------------------------------------------------------------------------- workers
def jddp_worker(steps: int) -> float:
    pin_to_own_core()
    from jddp.runtime import processes as runtime

    runtime.initialize()
    import jax
    import optax

    import jddp
    from jddp.models import MLP

    batch = synthetic_batch(jax.process_index(), jax.process_count())
    batch["label"] = batch["label"].astype(np.int32)
    trainer = jddp.Trainer(
        MLP(num_classes=10, hidden_sizes=tuple(LAYERS[1:-1])),
        jddp.losses.softmax_cross_entropy,
        optax.adam(1e-3),
        log_grad_norm=False,
    )
    state = trainer.init(seed=0, sample_batch=batch)
    placed = trainer.place_batch(batch)
    for _ in range(WARMUP):
        state, metrics = trainer.step(state, placed)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = trainer.step(state, placed)
    jax.block_until_ready(state)
    return time.perf_counter() - start


def torch_join() -> tuple[int, int]:
    """This process pinned to its core, 1 PyTorch thread, in the gloo group: (rank, world)."""
    rank = pin_to_own_core()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # jddp-launch keeps the coordinator's port bound for jax (SO_REUSEPORT), which PyTorch's
    # TCP store cannot share: rendezvous through a file named after that port instead.
    port = os.environ["JDDP_COORDINATOR_ADDRESS"].rsplit(":", 1)[1]
    world = int(os.environ["JDDP_NUM_PROCESSES"])
    store = os.path.join(tempfile.gettempdir(), f"jddp-bench-torch-{port}")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return rank, world


def torch_mlp(layer_sizes: list[int]):
    """Linear + ReLU layers of `layer_sizes` (the last without ReLU), seeded with 0."""
    import torch

    torch.manual_seed(0)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(layer_sizes[:-1], layer_sizes[1:], strict=True)):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i < len(layer_sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def torch_worker(steps: int) -> float:
    rank, world = torch_join()
    import torch
    import torch.distributed as dist

    model = torch.nn.parallel.DistributedDataParallel(torch_mlp(LAYERS))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = synthetic_batch(rank, world)
    x, y = torch.from_numpy(batch["image"]), torch.from_numpy(batch["label"])
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP all-reduces the gradient buckets during backward
        optimizer.step()
        return loss

    for _ in range(WARMUP):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return seconds


# --------------------------------------------------------------------------- parent
def launch(worker_args: list[str], module: str = "experiments.bench.multiprocess") -> str:
    """`python -m MODULE WORKER_ARGS` as 2 processes of 1 device under jddp-launch; returns
    what process 0 printed after `RESULT `. Either framework's processes start with the glibc
    malloc settings of jddp's programs (jddp/runtime/host_memory.py): PyTorch's steps page-fault
    the same way without them (2,500-19,000 faults a step of the communication benchmark's MLP)."""
    from jddp.runtime.host_memory import ENVIRONMENT

    command = [
        sys.executable,
        "-m",
        "jddp.runtime.launch",
        "--nproc=2",
        "--devices_per_proc=1",
        "--",
        sys.executable,
        "-m",
        module,
        *worker_args,
    ]
    env = {**os.environ, **ENVIRONMENT}
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)
    for line in result.stdout.splitlines():
        if line.startswith("[0] RESULT "):
            return line[len("[0] RESULT ") :]
    raise RuntimeError(f"{module} {worker_args} failed:\n{result.stdout[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--worker", choices=["jddp", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        seconds = {"jddp": jddp_worker, "torch": torch_worker}[args.worker](args.steps)
        print(f"RESULT {seconds}", flush=True)
        return

    from experiments.bench import common

    common.check_output_folder(args.out)

    times = {"jddp": [], "torch": []}
    for round_index in range(args.repeats):
        for framework in ("jddp", "torch") if round_index % 2 == 0 else ("torch", "jddp"):
            seconds = launch([f"--worker={framework}", f"--steps={args.steps}"])
            times[framework].append(float(seconds))
    rate = {f: GLOBAL_BATCH * args.steps / statistics.median(t) for f, t in times.items()}
    paired = statistics.median(t / j for j, t in zip(times["jddp"], times["torch"], strict=True))
    rows = [
        {
            "framework": f,
            "processes": 2,
            "examples_per_sec": rate[f],
            "median_run_sec": statistics.median(times[f]),
        }
        for f in times
    ]
    common.report(
        "multiprocess",
        rows,
        {
            "ratio_jddp_over_torch": paired,
            "repeats": args.repeats,
            "steps": args.steps,
            "all_sec": json.dumps(times),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
