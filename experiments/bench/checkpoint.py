"""Checkpoint costs: save and restore times, and the training slowdown with asynchronous
checkpoints every N steps against none.

    python -m experiments.bench.checkpoint [--repeats 5] [--steps 100] [--every 50 25]

Adam, float32, global batch 256 of synthetic data, 8 simulated CPU devices, ddp and zero3,
for the 1.9M-parameter MLP 784-1024-1024-10 and a 10M-parameter MLP 784-2048-2048-2048-10.
Save time = blocking part of an asynchronous save + time until committed; restore time = a
restore into the strategy's shardings. The slowdown compares timed windows of `--steps` steps
with a save every N steps against windows without, interleaved, as a paired ratio of medians.
"""

import argparse
import shutil
import tempfile
import time

import jax
import numpy as np
import optax

import jddp
from experiments.bench import common
from jddp.checkpoints.store import Checkpoints
from jddp.models import MLP

MODELS = {"mlp-1.9M": (1024, 1024), "mlp-10M": (2048, 2048, 2048)}
GLOBAL_BATCH = 256


def measure(model_name, hidden, strategy, args, scratch) -> list[dict]:
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.normal(size=(GLOBAL_BATCH, 784)).astype(np.float32),
        "label": rng.integers(0, 10, GLOBAL_BATCH).astype(np.int32),
    }
    trainer = jddp.Trainer(
        MLP(num_classes=10, hidden_sizes=hidden),
        jddp.losses.softmax_cross_entropy,
        optax.adam(1e-3),
        strategy=strategy,
    )
    holder = [trainer.init(seed=0, sample_batch=batch)]
    placed = trainer.place_batch(batch)
    state_mib = sum(x.nbytes for x in jax.tree.leaves(holder[0])) / 2**20

    # -- save and restore times
    directory = tempfile.mkdtemp(dir=scratch)
    checkpoints = Checkpoints(directory, every=1, max_to_keep=2)
    save_sec, restore_sec = [], []
    for step in range(1, args.repeats + 1):
        jax.block_until_ready(holder[0])
        start = time.perf_counter()
        checkpoints.save(step, holder[0], {}, force=True)
        blocking = time.perf_counter() - start
        checkpoints.wait()
        save_sec.append((blocking, time.perf_counter() - start))
        start = time.perf_counter()
        restored = checkpoints.restore_latest(trainer.abstract_state(batch))
        jax.block_until_ready(restored[1])
        restore_sec.append(time.perf_counter() - start)
    checkpoints.close()
    shutil.rmtree(directory)

    # -- training with checkpoints every N steps against none
    def window(every):
        def run():
            directory = tempfile.mkdtemp(dir=scratch)
            checkpoints = Checkpoints(directory, every=every, max_to_keep=2) if every else None
            state = holder[0]
            start = time.perf_counter()
            for step in range(1, args.steps + 1):
                state, _ = trainer.step(state, placed)
                if checkpoints is not None and checkpoints.due(step):
                    checkpoints.save(step, state, {}, force=True)
            jax.block_until_ready(state)
            seconds = time.perf_counter() - start  # saves still committing count from here on
            if checkpoints is not None:
                checkpoints.wait()
                checkpoints.close()
            shutil.rmtree(directory)
            holder[0] = state
            return seconds

        return run

    windows = {f"every {n}": window(n) for n in args.every} | {"none": window(0)}
    for run in windows.values():
        run()  # warm up
    timings = common.interleaved_medians(windows, args.repeats)
    row = {
        "model": model_name,
        "strategy": strategy,
        "state_MiB": state_mib,
        "save_blocking_sec": float(np.median([b for b, _ in save_sec])),
        "save_committed_sec": float(np.median([c for _, c in save_sec])),
        "restore_sec": float(np.median(restore_sec)),
        "step_ms": timings["none"]["median_sec"] / args.steps * 1e3,
    }
    for n in args.every:
        row[f"slowdown_every_{n}"] = 1 / common.paired_ratio(timings, f"every {n}", "none") - 1
    return [row]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="steps per timed window")
    parser.add_argument("--every", type=int, nargs="+", default=[50, 25])
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    jax.config.update("jax_num_cpu_devices", 8)
    scratch = tempfile.mkdtemp(prefix="jddp-bench-ckpt-")
    try:
        rows = [
            row
            for name, hidden in MODELS.items()
            for strategy in ("ddp", "zero3")
            for row in measure(name, hidden, strategy, args, scratch)
        ]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    common.report("checkpoint", rows, {"repeats": args.repeats, "steps": args.steps}, args.out)


if __name__ == "__main__":
    main()
