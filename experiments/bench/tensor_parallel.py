"""Tensor parallelism on 8 simulated devices: a GPT of 6 layers x 384 under ddp, FSDP, Megatron
tensor parallelism and their 2-D / 3-D meshes, with and without sequence parallelism.

    python -m experiments.bench.tensor_parallel [--repeats 3] [--steps 3] [--out bench_results]

For each layout: tokens/s (interleaved timed windows, medians; and the paired ratio to ddp),
per-device state and the compiled step's peak (XLA's memory analysis), and the bytes one device
sends per step counted from the compiled HLO in ring terms (all-reduce 2x its size,
reduce-scatter its input, all-gather its result), against the analytic formula:

    Megatron  (4 L + 2) activation all-reduces of B x T x E per step (2 per block forward, 2
              backward, one each way for the vocabulary-parallel embedding and head): 2 A each;
              with sequence parallelism the same count of all-gather / reduce-scatter pairs, 2 A
              per pair (the same volume, Korthikanti et al. 2022)
    ZeRO      per parameter tensor of b bytes per tensor rank: zero3 all-gather b + reduce-scatter
              b over fsdp when it is split over fsdp, else an all-reduce 2 b over the batch axes;
              2 b / fsdp more over data; ddp 2 b

A is the activation bytes of one device's rows (B = global batch / (data x fsdp)). Then the
mesh path with every axis of size 1 on one device against ddp on one device (its overhead).
"""

import argparse

import jax
import optax

import jddp
from experiments.bench import common
from jddp.models import GPT
from jddp.models.gpt import TENSOR_PARALLEL_RULES
from jddp.observe.hlo import collectives, ring_bytes
from jddp.parallel.rules import adapt_preset, spec_axes
from jddp.parallel.strategies import device_mesh_for
from jddp.run.objectives import OBJECTIVES

LM = OBJECTIVES["language_model"]
DEVICES, LAYERS, WIDTH, HEADS, VOCAB, SEQ, GLOBAL_BATCH = 8, 6, 384, 8, 1024, 128, 16
# (name, strategy, mesh, sequence parallel)
LAYOUTS = [
    ("ddp", "ddp", None, False),
    ("fsdp:8", "zero3", "fsdp:8", False),
    ("tensor:8", "zero3", "tensor:8", False),
    ("tensor:8 +SP", "zero3", "tensor:8", True),
    ("fsdp:4,tensor:2", "zero3", "fsdp:4,tensor:2", False),
    ("fsdp:4,tensor:2 +SP", "zero3", "fsdp:4,tensor:2", True),
    ("data:2,fsdp:2,tensor:2", "zero3", "data:2,fsdp:2,tensor:2", False),
    ("data:2,fsdp:2,tensor:2 +SP", "zero3", "data:2,fsdp:2,tensor:2", True),
]


def make_trainer(strategy, mesh, sp, devices):
    fields = dict(num_layers=LAYERS, num_heads=HEADS, embed_dim=WIDTH, max_seq_len=SEQ)
    device_mesh = device_mesh_for(strategy, mesh, devices)
    # ddp replicates every parameter: it takes no rules.
    rules = adapt_preset(TENSOR_PARALLEL_RULES, device_mesh) if strategy != "ddp" else ()
    layout = {"mesh": device_mesh, "rules": rules}
    model = GPT(VOCAB, **fields, tensor_axis=device_mesh.tensor_axis, sequence_parallel=sp)
    return jddp.Trainer(
        model,
        LM.loss_fn,
        optax.adamw(1e-3),
        input_key="inputs",
        strategy=strategy,
        devices=devices,
        log_grad_norm=False,
        **layout,
    )


def formula_ring_bytes(trainer, state) -> float:
    """The analytic bytes one device sends per step (see the module docstring)."""
    if trainer.strategy.name == "ddp":
        return 2 * 4 * sum(x.size for x in jax.tree.leaves(state.params))
    mesh = trainer.device_mesh
    data, fsdp, tensor = (mesh.size(r) for r in ("data", "fsdp", "tensor"))
    total = 0.0
    grad_specs = jax.tree.leaves(trainer.strategy.layout()[1])  # zero3: each parameter's layout
    for x, spec in zip(jax.tree.leaves(state.params), grad_specs, strict=True):
        split = "tensor" in spec_axes(spec)
        b = 4 * x.size / (tensor if split else 1)  # bytes per tensor rank
        if "fsdp" in spec_axes(spec):
            total += 2 * b + (2 * b / fsdp if data > 1 else 0)
        elif data * fsdp > 1:
            total += 2 * b
    if tensor > 1:
        activation = 4 * GLOBAL_BATCH // (data * fsdp) * SEQ * WIDTH
        total += (4 * LAYERS + 2) * 2 * activation
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed window")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    jax.config.update("jax_num_cpu_devices", DEVICES)
    batch = common.token_batch(VOCAB, GLOBAL_BATCH, SEQ)

    runs, rows = {}, []
    for name, strategy, mesh, sp in LAYOUTS:
        trainer = make_trainer(strategy, mesh, sp, jax.devices())
        state = trainer.init(seed=0, sample_batch=batch)
        placed = trainer.place_batch(batch)
        memory = trainer.memory_report(state, placed)
        compiled = trainer.strategy.lower_train_step(state, placed.arrays).compile()
        comm = ring_bytes(collectives(compiled.as_text()))
        formula = formula_ring_bytes(trainer, state)
        runs[name] = [trainer, state, placed]
        rows.append(
            {
                "layout": name,
                "state_MiB": memory["state_bytes_per_device"] / 2**20,
                "peak_MiB": memory["peak_bytes_per_device"] / 2**20,
                "comm_MiB": comm / 2**20,
                "comm_vs_formula": comm / formula,
            }
        )
    # One device: the mesh path with every axis of size 1 against ddp.
    one = jax.devices()[:1]
    for name, strategy, mesh in [
        ("1 device ddp", "ddp", None),
        ("1 device data:1,fsdp:1,tensor:1", "zero3", "data:1,fsdp:1,tensor:1"),
    ]:
        trainer = make_trainer(strategy, mesh, False, one)
        runs[name] = [trainer, trainer.init(seed=0, sample_batch=batch), trainer.place_batch(batch)]

    windows = common.trainer_windows(runs, args.steps)
    common.warm_up(windows)
    timings = common.interleaved_medians(windows, args.repeats)
    tokens_per_step = GLOBAL_BATCH * SEQ
    for row in rows:
        row["tokens_per_s"] = tokens_per_step * args.steps / timings[row["layout"]]["median_sec"]
        row["speed_vs_ddp"] = common.paired_ratio(timings, row["layout"], "ddp")
    one_device = common.paired_ratio(timings, "1 device data:1,fsdp:1,tensor:1", "1 device ddp")
    params = sum(x.size for x in jax.tree.leaves(runs["ddp"][1].params))
    common.report(
        "tensor_parallel",
        rows,
        {
            "model": f"GPT {LAYERS}x{WIDTH}, {HEADS} heads, vocab {VOCAB}, seq {SEQ}",
            "params": params,
            "devices": DEVICES,
            "global_batch": GLOBAL_BATCH,
            "one_device_mesh_path_vs_ddp": one_device,
            "repeats": args.repeats,
            "steps": args.steps,
            "max_abs_comm_error": max(abs(r["comm_vs_formula"] - 1) for r in rows),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
