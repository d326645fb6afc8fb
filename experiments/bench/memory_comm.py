"""Memory and communication of every strategy at 8 devices, against the ZeRO paper's formulas,
and each strategy's speed relative to ddp.

    python -m experiments.bench.memory_comm [--repeats 7] [--steps 5] [--out bench_results]

For two models (the 1.9M-parameter MLP 784-1024-1024-10 and a 10M-parameter MLP
784-2048-2048-2048-10), Adam in float32, global batch 256, 8 simulated CPU devices:
- state: bytes of parameters + optimizer state one device holds (its shards), against
  ddp 12 P, zero1/zero2 (4 + 8/N) P, zero3 12 P / N, hybrid 12 P / S (S = shard-group size);
- peak: the compiled step's peak bytes per device (XLA's memory_analysis);
- communication: bytes one device sends per step, counted from the compiled HLO in ring terms
  (all-reduce 2x its size, reduce-scatter its input, all-gather its result), against the
  paper's 2 x parameter bytes for ddp / zero1 / zero2 and 3 x for zero3;
- speed: examples/s in interleaved timed windows, as a paired ratio to ddp.
"""

import argparse

import jax
import numpy as np
import optax

import jddp
from experiments.bench import common
from jddp.models import MLP
from jddp.observe.hlo import collectives, ring_bytes

MODELS = {"mlp-1.9M": (1024, 1024), "mlp-10M": (2048, 2048, 2048)}
STRATEGIES = {
    "ddp": None,
    "zero1": None,
    "zero2": None,
    "zero3": None,
    "hybrid": "data:2,fsdp:4",
}
GLOBAL_BATCH, DEVICES = 256, 8


def paper_state_bytes(strategy: str, params: int, shard_group: int) -> float:
    n = DEVICES
    return {
        "ddp": 12 * params,
        "zero1": (4 + 8 / n) * params,
        "zero2": (4 + 8 / n) * params,
        "zero3": 12 * params / n,
        "hybrid": 12 * params / shard_group,
    }[strategy]


def paper_comm_bytes(strategy: str, params: int) -> float:
    return (3 if strategy in ("zero3", "hybrid") else 2) * 4 * params


def measure_model(name: str, hidden: tuple[int, ...], repeats: int, steps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.normal(size=(GLOBAL_BATCH, 784)).astype(np.float32),
        "label": rng.integers(0, 10, GLOBAL_BATCH).astype(np.int32),
    }
    runs, rows = {}, []
    for strategy, mesh in STRATEGIES.items():
        trainer = jddp.Trainer(
            MLP(num_classes=10, hidden_sizes=hidden),
            jddp.losses.softmax_cross_entropy,
            optax.adam(1e-3),
            strategy=strategy,
            mesh=mesh,
            log_grad_norm=False,
        )
        state = trainer.init(seed=0, sample_batch=batch)
        placed = trainer.place_batch(batch)
        params = sum(x.size for x in jax.tree.leaves(state.params))
        memory = trainer.memory_report(state, placed)
        compiled = trainer.strategy.lower_train_step(state, placed.arrays).compile()
        comm = ring_bytes(collectives(compiled.as_text()))
        shard_group = trainer.strategy.mesh.shape.get("fsdp", DEVICES)
        runs[strategy] = [trainer, state, placed]
        rows.append(
            {
                "model": name,
                "strategy": strategy,
                "params": params,
                "state_MiB": memory["state_bytes_per_device"] / 2**20,
                "state_vs_paper": memory["state_bytes_per_device"]
                / paper_state_bytes(strategy, params, shard_group),
                "peak_MiB": memory["peak_bytes_per_device"] / 2**20,
                "comm_MiB": comm / 2**20,
                "comm_vs_paper": comm / paper_comm_bytes(strategy, params),
            }
        )

    windows = common.trainer_windows(runs, steps)
    common.warm_up(windows)
    timings = common.interleaved_medians(windows, repeats)
    for row in rows:
        row["speed_vs_ddp"] = common.paired_ratio(timings, row["strategy"], "ddp")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed window")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    jax.config.update("jax_num_cpu_devices", DEVICES)
    rows = [
        row
        for name, hidden in MODELS.items()
        for row in measure_model(name, hidden, args.repeats, args.steps)
    ]
    common.report(
        "memory_comm",
        rows,
        {
            "devices": DEVICES,
            "global_batch": GLOBAL_BATCH,
            "repeats": args.repeats,
            "steps": args.steps,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
