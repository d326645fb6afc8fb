"""Training speed of the built-in models under every strategy, with and without remat: examples/s
(tokens/s), model FLOP/s and the fraction of the machine's measured matmul rate.

    python -m experiments.bench.models [--devices 1] [--repeats 5] [--steps 2] [--smoke]
        [--models mlp,resnet18_cifar,gpt_small,gpt_124m] [--strategies ddp,zero3]
        [--out bench_results]

One device-resident global batch per model, Adam, float32. For each model, the variants'
timed windows (`steps` steps each) are interleaved with 2048^3 matmul windows, `repeats` rounds,
order reversed every round; the fraction is the median over rounds of (model FLOP/s, all
devices) / (matmul FLOP/s of one device in the same round). Model FLOPs are jddp/observe/flops.py's:
remat's recomputation is not counted, so remat shows as a lower fraction. With `--devices` > 1
the devices are simulated CPU devices sharing the same cores: the fraction is then of the whole
machine. `--smoke` runs tiny sizes, to prove the benchmark works.
"""

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np
import optax

from experiments.bench import common

MODELS = ("mlp", "resnet18_cifar", "gpt_small", "gpt_124m")


@dataclasses.dataclass(frozen=True)
class Case:
    """A model at a benchmark size: `make(remat)` builds it; `batch` is one global batch."""

    name: str
    make: Callable[[bool], object]
    batch: dict[str, np.ndarray]
    kind: str  # "classification" or "language_model"
    has_remat: bool = True


def make_case(name: str, smoke: bool) -> Case:
    from jddp.models import GPT, MLP, ResNet

    rng = np.random.default_rng(0)
    if name == "mlp":
        width, batch = (64, 32) if smoke else (1024, 256)
        images = rng.normal(size=(batch, 784)).astype(np.float32)
        labels = rng.integers(0, 10, size=batch).astype(np.int32)
        return Case(
            name,
            lambda remat: MLP(10, (width, width)),
            {"image": images, "label": labels},
            "classification",
            has_remat=False,
        )
    if name == "resnet18_cifar":
        width, batch = (8, 8) if smoke else (64, 32)
        images = rng.normal(size=(batch, 32, 32, 3)).astype(np.float32)
        labels = rng.integers(0, 10, size=batch).astype(np.int32)
        return Case(
            name,
            lambda remat: ResNet(10, depth=18, stem="cifar", width=width, remat=remat),
            {"image": images, "label": labels},
            "classification",
        )
    sizes = {  # (layers, heads, width, seq_len, vocab, batch)
        "gpt_small": (2, 2, 64, 64, 65, 8) if smoke else (6, 6, 384, 256, 65, 16),
        "gpt_124m": (2, 4, 128, 128, 50304, 2) if smoke else (12, 12, 768, 1024, 50304, 2),
    }
    layers, heads, width, seq_len, vocab, batch = sizes[name]
    tokens = rng.integers(0, vocab, size=(batch, seq_len + 1)).astype(np.int32)
    return Case(
        name,
        lambda remat: GPT(vocab, layers, heads, width, max_seq_len=seq_len, remat=remat),
        {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
        "language_model",
    )


def variant(case: Case, strategy: str, remat: bool, devices):
    """(one timed window of `steps` steps -> seconds per step, FLOPs per step) for one variant."""
    import jddp
    from jddp.observe import flops
    from jddp.run.objectives import OBJECTIVES

    objective = OBJECTIVES[case.kind]
    model = case.make(remat)
    trainer = jddp.Trainer(
        model,
        objective.loss_fn,
        optax.adam(1e-4),
        strategy=strategy,
        devices=devices,
        input_key=objective.input_key,
        log_grad_norm=False,
    )
    state = trainer.init(seed=0, sample_batch=case.batch)
    placed = trainer.place_batch(case.batch)
    holder = {"state": state}

    def window(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            holder["state"], metrics = trainer.step(holder["state"], placed)
        jax.block_until_ready((holder["state"], metrics))
        return (time.perf_counter() - start) / steps

    step_flops = flops.train_step_flops(model, case.batch[objective.input_key])
    return window, step_flops.per_step


def bench_model(case: Case, strategies, devices, repeats: int, steps: int) -> list[dict]:
    variants, flops_per_step = {}, {}
    for strategy in strategies:
        for remat in (False, True) if case.has_remat else (False,):
            key = (strategy, remat)
            window, flops_per_step[key] = variant(case, strategy, remat, devices)
            window(1)  # compile and warm up
            variants[key] = lambda window=window: window(steps)
    variants["matmul"] = common.matmul_window(devices[0])
    timings = common.interleaved_medians(variants, repeats)
    matmul_flops = 2 * common.MATMUL_SIZE**3
    rows = []
    batch = len(next(iter(case.batch.values())))
    tokens = case.batch["inputs"].shape[1] if case.kind == "language_model" else 0
    for (strategy, remat), step_flops in flops_per_step.items():
        step_sec = timings[(strategy, remat)]["median_sec"]
        paired = [  # each round's model FLOP/s over the same round's matmul rate
            (step_flops / s) / (matmul_flops / m)
            for s, m in zip(
                timings[(strategy, remat)]["all_sec"], timings["matmul"]["all_sec"], strict=True
            )
        ]
        rows.append(
            {
                "model": case.name,
                "strategy": strategy,
                "remat": remat,
                "devices": len(devices),
                "global_batch": batch,
                "step_ms": step_sec * 1e3,
                "examples_per_sec": batch / step_sec,
                "tokens_per_sec": batch * tokens / step_sec if tokens else "-",
                "model_gflops_per_sec": step_flops / step_sec / 1e9,
                "matmul_gflops_per_sec": matmul_flops / timings["matmul"]["median_sec"] / 1e9,
                "fraction_of_matmul_rate": statistics.median(paired),
            }
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed window")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--strategies", default="", help="comma-separated; default: all")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 rounds of 1 step")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.smoke:
        args.repeats, args.steps = 2, 1
    import jddp

    devices = jax.devices()[: args.devices]
    strategies = args.strategies.split(",") if args.strategies else sorted(jddp.STRATEGIES)
    rows = []
    for name in args.models.split(","):
        rows += bench_model(
            make_case(name, args.smoke), strategies, devices, args.repeats, args.steps
        )
        gc.collect()
    gpt = [r for r in rows if r["model"] == "gpt_small" and not r["remat"]]
    extra = {
        "repeats": args.repeats,
        "steps_per_window": args.steps,
        "smoke": args.smoke,
        "gpt_small_fraction_of_matmul_rate": max(r["fraction_of_matmul_rate"] for r in gpt)
        if gpt
        else None,
        "fraction_target": 0.6,
    }
    common.report("models_smoke" if args.smoke else "models", rows, extra, args.out)


if __name__ == "__main__":
    main()
