"""Mixture of experts on 8 simulated devices: an MoE GPT (8 experts, 2 per token) with its
experts split over an `expert` axis (on `expert:2,fsdp:2,tensor:2` each expert's MLP split over
tensor too, Megatron-style), beside the same model with its experts whole on every device
(fsdp:8) and the same model dense with compute matched (one MLP as wide as a token's 2
experts: the same matmul FLOPs per token, less the router's), all under zero3.

    python -m experiments.bench.moe [--repeats 3] [--steps 2] [--out bench_results]

For each layout: tokens/s (interleaved timed windows, medians; and the paired ratio to the
dense model), per-device state, the bytes of the compiled step's all-to-alls over `expert`
(jddp/observe/hlo.py `bytes_by_axes`) against the formula (jddp/models/moe_dispatch.py
`all_to_all_bytes`, times the layers), and whether the planner's collectives
(jddp/planner/comm.py) equal the compiled step's on every axis. A layout this jddp refuses is
reported with its one-line reason.
"""

import argparse

import jax
import numpy as np
import optax

import jddp
from experiments.bench import common
from jddp.errors import ConfigError
from jddp.models import GPT
from jddp.models.gpt import TENSOR_PARALLEL_RULES
from jddp.models.moe_dispatch import all_to_all_bytes
from jddp.models.moe_settings import moe_settings
from jddp.observe.hlo import bytes_by_axes, collective_ops
from jddp.parallel.rules import adapt_preset
from jddp.parallel.strategies import device_mesh_for
from jddp.planner import collective, comm
from jddp.planner.layouts import Layout
from jddp.planner.workload import model_workload
from jddp.run.objectives import OBJECTIVES

LM = OBJECTIVES["language_model"]
DEVICES, LAYERS, WIDTH, HEADS, VOCAB, SEQ, GLOBAL_BATCH = 8, 2, 256, 4, 512, 128, 16
EXPERTS, PER_TOKEN, EXPERT_DIM = 8, 2, 256
MOE = {"num_experts": EXPERTS, "experts_per_token": PER_TOKEN, "expert_dim": EXPERT_DIM}
DENSE = "dense fsdp:8"  # the reference every speed is a ratio to
# (name, mesh, model_args.moe or None for the dense model of matched compute)
LAYOUTS = [
    (DENSE, "fsdp:8", None),
    ("moe fsdp:8", "fsdp:8", MOE),
    ("moe expert:8", "expert:8", MOE),
    ("moe expert:4,fsdp:2", "expert:4,fsdp:2", MOE),
    ("moe expert:2,fsdp:2,tensor:2", "expert:2,fsdp:2,tensor:2", MOE),
]


def make_trainer(mesh: str, moe, devices):
    device_mesh = device_mesh_for("zero3", mesh, devices)
    width = {"moe": moe} if moe else {"mlp_dim": PER_TOKEN * EXPERT_DIM}
    model = GPT(
        VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        embed_dim=WIDTH,
        max_seq_len=SEQ,
        tensor_axis=device_mesh.tensor_axis,
        batch_axis_name="batch",
        expert_axis=device_mesh.expert_axis,
        **width,
    )
    return jddp.Trainer(
        model,
        LM.loss_fn,
        optax.adamw(1e-3),
        metrics=dict(LM.metrics),  # a run's: the loss and accuracy (vocabulary-parallel on tensor)
        input_key="inputs",
        strategy="zero3",
        devices=devices,
        mesh=device_mesh,
        rules=adapt_preset(TENSOR_PARALLEL_RULES, device_mesh),
        log_grad_norm=False,
    )


def all_to_all_row(trainer, state, placed, batch) -> dict:
    """The compiled step's all-to-all bytes over `expert` per device, their ratio to the
    formula (1.0: equal; None without an expert axis), and whether the planner's bytes per
    axis and kind equal the compiled step's."""
    mesh = trainer.device_mesh
    text = trainer.strategy.lower_train_step(state, placed.arrays).compile().as_text()
    ids = np.vectorize(lambda d: d.id)(mesh.mesh.devices)
    moved = bytes_by_axes(collective_ops(text), ids, mesh.axis_names)
    workload = model_workload(
        trainer.task.model,
        batch["inputs"][:1],
        GLOBAL_BATCH,
        optax.adamw(1e-3),
        rules_for=lambda mesh: adapt_preset(TENSOR_PARALLEL_RULES, mesh),
    )
    layout = Layout("zero3", **{a: mesh.size(a) for a in mesh.axis_names})
    planned = collective.bytes_by_axes(comm.step_collectives(workload, layout))
    compiled = moved.get((("expert",), "all-to-all"), 0)
    row = {"all_to_all_MiB": compiled / 2**20, "planner_equal": planned == moved}
    if mesh.size("expert") == 1:
        return row | {"all_to_all_vs_formula": None}
    formula = LAYERS * all_to_all_bytes(
        moe_settings(MOE),
        tokens_per_device=GLOBAL_BATCH * SEQ // mesh.batch_slices,
        batch_slices=mesh.batch_slices,
        embed_dim=WIDTH,
        expert_size=mesh.size("expert"),
    )
    return row | {"all_to_all_vs_formula": compiled / formula}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed window")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    jax.config.update("jax_num_cpu_devices", DEVICES)
    batch = common.token_batch(VOCAB, GLOBAL_BATCH, SEQ)

    runs, rows, refused = {}, [], {}
    for name, mesh, moe in LAYOUTS:
        try:  # the model refuses a layout when its step is first traced
            trainer = make_trainer(mesh, moe, jax.devices())
            state = trainer.init(seed=0, sample_batch=batch)
            placed = trainer.place_batch(batch)
            memory = trainer.memory_report(state, placed)
        except ConfigError as e:  # what this jddp does not run yet
            refused[name] = str(e)
            continue
        runs[name] = [trainer, state, placed]
        row = {"layout": name, "state_MiB": memory["state_bytes_per_device"] / 2**20}
        rows.append(row | all_to_all_row(trainer, state, placed, batch))

    windows = common.trainer_windows(runs, args.steps)
    common.warm_up(windows)
    timings = common.interleaved_medians(windows, args.repeats)
    for row in rows:
        seconds = timings[row["layout"]]["median_sec"]
        row["tokens_per_s"] = GLOBAL_BATCH * SEQ * args.steps / seconds
        row["speed_vs_dense"] = common.paired_ratio(timings, row["layout"], DENSE)
    common.report(
        "moe",
        rows,
        {
            "model": f"GPT {LAYERS}x{WIDTH}, {HEADS} heads, vocab {VOCAB}, seq {SEQ}",
            "moe": MOE,
            "dense_mlp_dim": PER_TOKEN * EXPERT_DIM,
            "devices": DEVICES,
            "global_batch": GLOBAL_BATCH,
            "repeats": args.repeats,
            "steps": args.steps,
            "refused": refused,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
