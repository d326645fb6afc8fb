"""jddp's strategies against the sharded `jax.jit` a JAX user writes in thirty lines.

    python -m experiments.bench.sharded_jit [--repeats 3] [--steps 0] [--rows 4,16,64,256,512]
        [--models mlp,gpt] [--out bench_results]

The hand-written step (`hand_written_step` below) is FSDP as the JAX documentation and MaxText
write it: one `jax.jit` over the global batch, every parameter and Adam moment sharded over the
mesh's one axis along its largest divisible dimension, the batch sharded over the same axis, and
XLA's SPMD partitioner choosing the collectives. Beside it, on the same 8 simulated CPU devices
and the same model, optimizer and batches: jddp's ddp, zero1, zero2, zero3, auto, and for the GPT
the tensor meshes (fsdp:4,tensor:2 under zero3 and auto). Per cell (model x rows per device):
examples/s, the paired ratio to the hand-written jit (median over interleaved rounds), the bytes
the compiled step's collectives move per device (ring terms), and the state bytes per device.

Models: the MLP 784-1024-1024-10 (1.9M parameters) and a GPT of 2 layers, width 128, 4 heads,
sequence 32, vocabulary 256 (0.4M parameters); Adam 1e-3, float32. Each timed window runs the
steps that take the hand-written jit about half a second (`--steps` fixes the count instead).
"""

import argparse
import math
import os

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jddp
from experiments.bench import common
from jddp.models import GPT, MLP
from jddp.models.gpt import TENSOR_PARALLEL_RULES
from jddp.observe import hlo
from jddp.parallel.rules import adapt_preset
from jddp.parallel.strategies import device_mesh_for
from jddp.run.cli import fail

DEVICES = 8
HAND = "hand-written jit"
# (strategy, mesh); the tensor meshes only where the model has tensor-parallel rules (the GPT).
STRATEGIES = {
    "ddp": None,
    "zero1": None,
    "zero2": None,
    "zero3": None,
    "auto": None,
    "zero3 fsdp:4,tensor:2": "fsdp:4,tensor:2",
    "auto fsdp:4,tensor:2": "fsdp:4,tensor:2",
}
GPT_DIMS = dict(vocab_size=256, num_layers=2, num_heads=4, embed_dim=128, max_seq_len=32)
WINDOW_SEC = 0.5  # each timed window runs as many steps as take about this long (at least 1)


# --------------------------------------------------------------------------- models
def mlp_case(rows: int, tensor_axis=None):
    del tensor_axis  # the MLP has no tensor-parallel rules
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.normal(size=(rows, 784)).astype(np.float32),
        "label": rng.integers(0, 10, rows).astype(np.int32),
    }
    model = MLP(num_classes=10, hidden_sizes=(1024, 1024))
    return model, jddp.losses.softmax_cross_entropy, "image", batch


def gpt_case(rows: int, tensor_axis=None):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, GPT_DIMS["vocab_size"], (rows, GPT_DIMS["max_seq_len"] + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    model = GPT(**GPT_DIMS, tensor_axis=tensor_axis)
    return model, jddp.losses.token_cross_entropy, "inputs", batch


MODELS = {"mlp": mlp_case, "gpt": gpt_case}


# ------------------------------------------------------------ the hand-written jit
def largest_divisible_spec(shape, size: int) -> P:
    """Shard the largest dimension that divides by `size`; replicate if none does."""
    divisible = [d for d in range(len(shape)) if shape[d] % size == 0]
    if not divisible:
        return P()
    dim = max(divisible, key=lambda d: shape[d])
    return P(*([None] * dim), "fsdp")


def hand_written_step(model, loss_fn, input_key, batch):
    """(jitted step, state, placed batch): FSDP the way a JAX user writes it."""
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("fsdp",))
    optimizer = optax.adam(1e-3)
    params = model.init(jax.random.key(0), batch[input_key][:1])["params"]
    opt_state = optimizer.init(params)

    def shard(tree):
        return jax.tree.map(
            lambda x: NamedSharding(mesh, largest_divisible_spec(np.shape(x), DEVICES)), tree
        )

    state_shardings = (shard(params), shard(opt_state))
    data_sharding = NamedSharding(mesh, P("fsdp"))

    def loss(params, batch):
        outputs = model.apply({"params": params}, batch[input_key])
        per_example = loss_fn(outputs, batch)
        values, weights = per_example if isinstance(per_example, tuple) else (per_example, None)
        return values.sum() / weights.sum() if weights is not None else values.mean()

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    step = jax.jit(
        step,
        in_shardings=(state_shardings, data_sharding),
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    state = jax.device_put((params, opt_state), state_shardings)
    placed = jax.device_put(batch, data_sharding)
    return step, state, placed


# ------------------------------------------------------------------------ jddp's
def jddp_run(model_name: str, strategy: str, mesh: str | None, rows: int):
    name = strategy.split()[0]
    device_mesh = device_mesh_for(name, mesh, jax.devices()[:DEVICES])
    model, loss_fn, input_key, batch = MODELS[model_name](rows, device_mesh.tensor_axis)
    layout = {}
    if name != "ddp":
        layout = {"mesh": device_mesh}
        if device_mesh.tensor_axis:
            layout["rules"] = adapt_preset(TENSOR_PARALLEL_RULES, device_mesh)
    trainer = jddp.Trainer(
        model,
        loss_fn,
        optax.adam(1e-3),
        strategy=name,
        input_key=input_key,
        log_grad_norm=False,
        devices=jax.devices()[:DEVICES] if name == "ddp" else None,
        **layout,
    )
    state = trainer.init(seed=0, sample_batch=batch)
    placed = trainer.place_batch(batch)
    memory = trainer.memory_report(state, placed)
    return {
        "run": [trainer, state, placed],
        "comm": memory["comm_bytes_per_step"],
        "state": memory["state_bytes_per_device"],
    }


def hand_window(run: list, steps: int):
    def window():
        step, state, placed = run
        run[1], seconds = common.timed_steps(step, state, placed, steps)
        return seconds

    return window


def measure_cell(model_name: str, rows_per_device: int, repeats: int, steps: int) -> list[dict]:
    rows = rows_per_device * DEVICES
    model, loss_fn, input_key, batch = MODELS[model_name](rows)
    hand = list(hand_written_step(model, loss_fn, input_key, batch))
    compiled = hand[0].lower(hand[1], hand[2]).compile()
    if not steps:  # as many as take the hand-written step about WINDOW_SEC (after compiling)
        hand[1], _ = common.timed_steps(hand[0], hand[1], hand[2], 1)
        hand[1], seconds = common.timed_steps(hand[0], hand[1], hand[2], 1)
        steps = max(1, min(50, round(WINDOW_SEC / seconds)))
    hand_state = sum(
        shard.data.nbytes for x in jax.tree.leaves(hand[1]) for shard in x.addressable_shards[:1]
    )
    cells = {HAND: {"comm": hlo.step_ring_bytes(compiled.as_text()), "state": hand_state}}
    windows = {HAND: hand_window(hand, steps)}
    jddp_runs = {}
    for strategy, mesh in STRATEGIES.items():
        if mesh and "tensor" in mesh and model_name != "gpt":
            continue
        cells[strategy] = jddp_run(model_name, strategy, mesh, rows)
        jddp_runs[strategy] = cells[strategy]["run"]
    windows.update(common.trainer_windows(jddp_runs, steps))
    common.warm_up(windows)
    timings = common.interleaved_medians(windows, repeats)
    result = []
    for name, cell in cells.items():
        result.append(
            {
                "model": model_name,
                "rows_per_device": rows_per_device,
                "variant": name,
                "steps_per_window": steps,
                "examples_per_sec": rows * steps / timings[name]["median_sec"],
                "vs_hand_written": common.paired_ratio(timings, name, HAND),
                "comm_MiB": cell["comm"] / 2**20,
                "state_MiB": cell["state"] / 2**20,
            }
        )
        print(
            f"{model_name} {rows_per_device:>4} rows/device {name:<22} "
            f"{result[-1]['examples_per_sec']:>9,.0f} ex/s  x{result[-1]['vs_hand_written']:.2f}",
            flush=True,
        )
    return result


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        variants = dict.fromkeys(r["variant"] for r in rows if r["model"] == model)
        for variant in variants:
            points = [r for r in rows if r["model"] == model and r["variant"] == variant]
            ax.plot(
                [p["rows_per_device"] for p in points],
                [p["vs_hand_written"] for p in points],
                marker="o",
                linestyle="--" if variant == HAND else "-",
                label=variant,
            )
        ax.axhline(0.95, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows per device (8 simulated devices)")
        ax.set_ylabel("examples/s / hand-written sharded jit")
        ax.set_title(model)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="steps per window (0: ~0.5 s)")
    parser.add_argument("--rows", default="4,16,64,256,512", help="rows per device")
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    models = args.models.split(",")
    if any(m not in MODELS for m in models):
        fail(f"--models {args.models!r}: choose from {', '.join(MODELS)}")
    sizes = [int(r) for r in args.rows.split(",") if r.strip().isdigit()]
    if len(sizes) != len(args.rows.split(",")) or not all(sizes):
        fail(f"--rows {args.rows!r}: give positive integers, e.g. 4,32,512")
    if args.repeats < 1 or args.steps < 0:
        fail("--repeats must be at least 1 and --steps at least 0 (0: about 0.5 s)")
    common.check_output_folder(args.out)
    jax.config.update("jax_num_cpu_devices", DEVICES)
    rows = [
        row
        for model in models
        for size in sizes
        for row in measure_cell(model, size, args.repeats, args.steps)
    ]
    best = {}
    for row in rows:
        if row["variant"] != HAND:
            key = (row["model"], row["rows_per_device"])
            best[key] = max(best.get(key, 0.0), row["vs_hand_written"])
    auto = [r["vs_hand_written"] for r in rows if r["variant"] == "auto"]
    os.makedirs(args.out, exist_ok=True)
    plot(rows, os.path.join(args.out, "sharded_jit.png"))
    common.report(
        "sharded_jit",
        rows,
        {
            "devices": DEVICES,
            "repeats": args.repeats,
            "steps": args.steps,
            "best_jddp_vs_hand_written_min": min(best.values()),
            "auto_vs_hand_written_min": min(auto) if auto else math.nan,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
