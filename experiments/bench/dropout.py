"""What layout-independent dropout costs: a GPT step with dropout 0.1 drawn from row keys (jddp's
default: an example's numbers depend on its row of the global batch, jddp/core/row_keys.py) against
the same step drawing from a per-device key (each device its own stream, as PyTorch DDP and
jddp before row keys: the run then depends on the device count) and against no dropout.

    python -m experiments.bench.dropout [--repeats 5] [--steps 3] [--out bench_results]

The GPT is the tensor-parallel benchmark's (6 layers x 384, sequence 128, global batch 16), under
ddp on 8 simulated devices and on 1 device. Step times are medians of interleaved windows; the
ratios are paired per round (see common.paired_ratio).
"""

import argparse

import jax
import numpy as np
import optax

import jddp
from experiments.bench import common
from jddp.models import GPT
from jddp.run.objectives import OBJECTIVES

LM = OBJECTIVES["language_model"]
DEVICES, LAYERS, WIDTH, HEADS, VOCAB, SEQ, GLOBAL_BATCH, RATE = 8, 6, 384, 8, 1024, 128, 16, 0.1
VARIANTS = ("row keys", "per-device keys", "no dropout")


def per_device_key(step_key, index, batch):
    """The scheme row keys replaced: the step's key folded with the device's index."""
    del batch
    return jax.random.fold_in(step_key, index)


def make_run(variant: str, devices):
    rate = 0.0 if variant == "no dropout" else RATE
    model = GPT(
        VOCAB, num_layers=LAYERS, num_heads=HEADS, embed_dim=WIDTH, max_seq_len=SEQ,
        dropout_rate=rate,
    )  # fmt: skip
    trainer = jddp.Trainer(
        model, LM.loss_fn, optax.adamw(1e-3), input_key="inputs", devices=devices,
        log_grad_norm=False,
    )  # fmt: skip
    if variant == "per-device keys":  # before the first step compiles
        object.__setattr__(trainer.task, "slice_key", per_device_key)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (GLOBAL_BATCH, SEQ), dtype=np.int32)
    batch = {"inputs": tokens, "targets": tokens}
    state = trainer.init(seed=0, sample_batch=batch)
    return [trainer, state, trainer.place_batch(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    jax.config.update("jax_num_cpu_devices", DEVICES)
    rows = []
    for count in (DEVICES, 1):
        devices = jax.devices()[:count]
        runs = {variant: make_run(variant, devices) for variant in VARIANTS}
        windows = common.trainer_windows(runs, args.steps)
        common.warm_up(windows)
        timings = common.interleaved_medians(windows, args.repeats)
        for variant in VARIANTS:
            seconds = timings[variant]["median_sec"] / args.steps
            rows.append({
                "devices": count,
                "variant": variant,
                "step_ms": 1e3 * seconds,
                "tokens_per_s": GLOBAL_BATCH * SEQ / seconds,
                "row_keys_time_ratio": common.paired_ratio(timings, variant, "row keys"),
            })  # fmt: skip
    common.report(
        "dropout",
        rows,
        {"note": "row_keys_time_ratio: a row-key step's time over this variant's (paired)"},
        args.out,
    )


if __name__ == "__main__":
    main()
