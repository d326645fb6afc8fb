"""GPT-124M training MFU on one GPU, bfloat16 compute: what `experiments/bench/gpu.sh` runs.

    python -m experiments.bench.gpu_mfu [--budget-sec 300] [--small] [--out bench_results]

jddp's own step (the shared core under the ddp strategy on one device): GPT-2 small's shape
(12 layers, width 768, 1024 positions, vocabulary 50,304, tied embeddings), AdamW with
float32 master weights, global-norm clipping, bfloat16 activations and matmuls. Variants
(attention implementation x batch size) run in order of promise, none starting after
`--budget-sec`; each compiles, warms up, then times 3 windows of 10 steps (median); the JSON is
saved after each. MFU = model FLOPs (jddp/observe/flops.py: 6 N tokens + attention) / step time
/ the datasheet peak (jddp/observe/device_peak.py).
A variant that fails (cuDNN attention unavailable, out of memory) is reported and skipped.
`--small` runs a tiny GPT on whatever device there is (CPU: the measured matmul rate is the peak),
to check the script without a GPU.
"""

import argparse
import gc
import os
import statistics
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (attention implementation, global batch of 1024-token sequences), most promising first.
VARIANTS = [("cudnn", 16), ("xla", 16), ("cudnn", 32), ("cudnn", 8), ("xla", 8)]
SMALL_VARIANTS = [("xla", 4), ("xla", 8)]
COLUMNS = (
    "attention",
    "global_batch",
    "compile_and_warmup_sec",
    "step_ms",
    "tokens_per_sec",
    "model_tflops_per_sec",
    "mfu",
)


def import_jddp_core() -> None:
    """Makes jddp's core importable on a machine that has only the JAX stack.

    `import jddp` also loads the data and config layers (TFDS, grain, ml_collections), which a
    bare GPU machine lacks. This benchmark needs none of them: if the full import fails, `jddp`
    is registered as a plain package, so its core, models, strategies and FLOP counting import
    without `jddp/__init__.py`.
    """
    try:
        import jddp  # noqa: F401
    except ImportError as error:
        for name in [n for n in sys.modules if n == "jddp" or n.startswith("jddp.")]:
            del sys.modules[name]
        package = types.ModuleType("jddp")
        package.__path__ = [os.path.join(REPO, "jddp")]
        sys.modules["jddp"] = package
        print(f"note: full `import jddp` unavailable ({error}); using its core only")


def make_variant(attention: str, batch_size: int, small: bool, device):
    """(a window of `steps` steps -> seconds per step, FLOPs per step) for one variant."""
    import jax
    import numpy as np
    import optax

    from jddp.core.task import Task
    from jddp.models.gpt import GPT
    from jddp.observe import flops
    from jddp.parallel.strategies import device_mesh_for, make_strategy
    from jddp.run.objectives import OBJECTIVES

    if small:
        model = GPT(512, 2, 4, 128, max_seq_len=128, attention_impl=attention)
    else:
        model = GPT(50304, 12, 12, 768, max_seq_len=1024, attention_impl=attention)
    seq_len = model.max_seq_len
    objective = OBJECTIVES["language_model"]
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(6e-4, b2=0.95, weight_decay=0.1)
    )
    task = Task(
        model,
        objective.loss_fn,
        optimizer,
        input_key=objective.input_key,
        compute_dtype=jax.numpy.bfloat16,
        log_grad_norm=False,
    )
    strategy = make_strategy("ddp", task, device_mesh_for("ddp", devices=[device]))
    tokens = np.random.default_rng(0).integers(0, 50257, size=(batch_size, seq_len + 1))
    tokens = (tokens % model.vocab_size).astype(np.int32)
    batch = strategy.place_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    holder = {"state": strategy.init_state(0, np.asarray(tokens[:1, :-1]))}

    def window(steps: int) -> float:
        start = time.perf_counter()
        for i in range(steps):
            holder["state"], metrics = strategy.train_step(holder["state"], batch)
            if i % 4 == 3:  # a bounded number of steps in flight, as the Trainer keeps
                metrics["loss"].block_until_ready()
        jax.block_until_ready((holder["state"], metrics))
        return (time.perf_counter() - start) / steps

    return window, flops.decoder_train_flops(model, batch_size, seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-sec", type=float, default=300.0)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    started = time.perf_counter()
    import_jddp_core()
    import jax

    from experiments.bench import common

    common.check_output_folder(args.out)
    from jddp.observe.device_peak import peak_flops_per_device

    device = jax.devices()[0]
    if device.platform != "gpu" and not args.small:
        sys.exit(f"error: no GPU found (device: {device.device_kind}); use --small on a CPU")
    peak, peak_source = peak_flops_per_device(device, "bfloat16")
    if peak is None:
        sys.exit(f"error: {peak_source}")
    peak_text = f"peak {peak / 1e12:.3g} TFLOP/s ({peak_source})"
    print(f"{device.device_kind}: {peak_text}, jax {jax.__version__}")

    rows = []
    name = "gpu_mfu_small" if args.small else "gpu_mfu"
    for attention, batch_size in SMALL_VARIANTS if args.small else VARIANTS:
        if time.perf_counter() - started > args.budget_sec:
            print(f"budget of {args.budget_sec:.0f} s spent; skipping {attention}/{batch_size}")
            continue
        rows.append(measure(attention, batch_size, args.small, device, peak))
        gc.collect()  # free this variant's state before the next one compiles
        # Saved after every variant: a run stopped by the time limit keeps what it measured.
        so_far = summary(device, peak, rows, started, args.small)
        common.write_json(
            os.path.join(args.out, f"{name}.json"), {"rows": rows, **so_far, "partial": True}
        )
    common.report(name, rows, summary(device, peak, rows, started, args.small), args.out)
    if not any(isinstance(r["mfu"], float) for r in rows):
        sys.exit("error: every variant failed")


def measure(attention: str, batch_size: int, small: bool, device, peak: float) -> dict:
    """One row of the table: compile, warm up, then the median of 3 timed windows."""
    row = dict.fromkeys(COLUMNS, "-") | {"attention": attention, "global_batch": batch_size}
    try:
        window, step_flops = make_variant(attention, batch_size, small, device)
        compile_start = time.perf_counter()
        window(2)
        row["compile_and_warmup_sec"] = time.perf_counter() - compile_start
        step_sec = statistics.median(window(3 if small else 10) for _ in range(3))
    except Exception as error:  # report the variant as failed, go on
        print(f"{attention}/{batch_size} failed: {type(error).__name__}: {error}"[:400])
        return {**row, "step_ms": "failed"}
    tokens = batch_size * (128 if small else 1024)
    row.update(
        step_ms=step_sec * 1e3,
        tokens_per_sec=tokens / step_sec,
        model_tflops_per_sec=step_flops / step_sec / 1e12,
        mfu=step_flops / step_sec / peak,
    )
    print(row, flush=True)
    return row


def summary(device, peak: float, rows: list[dict], started: float, small: bool) -> dict:
    measured = [r["mfu"] for r in rows if isinstance(r["mfu"], float)]
    return {
        "device": device.device_kind,
        "peak_tflops_per_sec": peak / 1e12,
        "best_mfu": max(measured) if measured else None,
        "mfu_target": 0.45,
        "small": small,
        "wall_sec": time.perf_counter() - started,
    }


if __name__ == "__main__":
    main()
