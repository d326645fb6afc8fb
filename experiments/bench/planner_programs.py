"""The tiny GPT's compiled train steps under planner layouts, and its planner workload: what the
byte-equality test (and experiments/bench/planner.py --bytes, over every layout) compares."""

import jax
import numpy as np

import jddp
from experiments.bench.tiny_gpt import BATCH, SEQ, VOCAB, WIDTH, adamw, token_batches
from jddp.core.task import init_compiler_options
from jddp.models import GPT
from jddp.models.gpt import TENSOR_PARALLEL_RULES
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.rules import adapt_preset
from jddp.parallel.strategies import device_mesh_for
from jddp.planner.workload import model_workload
from jddp.run.objectives import OBJECTIVES

LAYERS = 1  # one block shows every per-layer collective; fewer ops compile faster
SCHEDULE = "1f1b"  # with a stage axis (GPipe runs the same ticks and sends)


def tiny_model(heads: int, layers: int = LAYERS, **mesh_fields) -> GPT:
    return GPT(
        VOCAB, num_layers=layers, num_heads=heads, embed_dim=WIDTH, max_seq_len=SEQ,
        **mesh_fields,
    )  # fmt: skip


def tiny_workload(
    heads: int = 4,
    layers: int = LAYERS,
    microbatches: int = 0,
    grad_comm_dtype="float32",
    lora=None,
    moe=None,
):
    """The planner's view of the tiny GPT as `compiled_text` trains it (Megatron's rules on
    every mesh, every tensor sharded however small; with `lora`, its adapters on a frozen
    base; with `moe` (`model_args.moe`), a mixture of experts in every block)."""
    return model_workload(
        tiny_model(heads, layers, moe=moe),
        np.zeros((1, SEQ), np.int32),
        BATCH,
        adamw(),
        rules_for=lambda mesh: adapt_preset(TENSOR_PARALLEL_RULES, mesh),
        min_shard_size=1,
        microbatches=microbatches,
        grad_comm_bytes=2 if grad_comm_dtype == "bfloat16" else 0,
        lora=lora,
    )


def compiled_text(
    layout,
    heads: int = 4,
    layers: int = LAYERS,
    microbatches: int = 0,
    grad_comm_dtype="float32",
    lora=None,
    moe=None,
) -> tuple[str, list[str], np.ndarray]:
    """(the compiled train step's HLO text, the mesh's axis names, its device ids shaped like
    the mesh) of the tiny GPT under `layout` on the first devices; a stage axis pipelines
    `layers` layers over `microbatches` micro-batches (0: as many as stages); gradients
    reduced in `grad_comm_dtype`; with `lora` (a `jddp.LoRA`), adapters on a frozen base; with
    `moe`, a mixture of experts, split over the mesh's expert axis if it has one."""
    devices = jax.devices()[: layout.devices]
    lm = OBJECTIVES["language_model"]
    if layout.strategy == "ddp":
        model = tiny_model(heads, layers, moe=moe, batch_axis_name="batch")
        kwargs = {"devices": devices}
        names, shape = ["data"], [layout.devices]
    else:
        mesh = device_mesh_for(layout.strategy, layout.mesh_spec, devices)
        rules = adapt_preset(TENSOR_PARALLEL_RULES, mesh)
        kwargs = {"mesh": mesh, "rules": rules, "min_shard_size": 1}
        if mesh.stage_axis:
            kwargs["pipeline"] = PipelineOptions(microbatches=microbatches, schedule=SCHEDULE)
        model = tiny_model(
            heads, layers, tensor_axis=mesh.tensor_axis,
            sequence_parallel=layout.sequence_parallel, scan_layers=bool(mesh.stage_axis),
            moe=moe, batch_axis_name="batch", expert_axis=mesh.expert_axis,
            context_axis=mesh.context_axis,
        )  # fmt: skip
        names, shape = list(mesh.axis_names), [mesh.size(a) for a in mesh.axis_names]
    trainer = jddp.Trainer(
        model, lm.loss_fn, adamw(), metrics=dict(lm.metrics), input_key="inputs",
        strategy=layout.strategy, grad_comm_dtype=grad_comm_dtype, lora=lora, **kwargs,
    )  # fmt: skip
    batch = token_batches(steps=1)[0]
    state = trainer.abstract_state(batch)
    placed = trainer.strategy.abstract_batch(batch)
    lowered = trainer.strategy.lower_train_step(state, placed)
    # No LLVM optimization: the collectives are fixed by the HLO passes before it (the
    # program is never run), and the compile takes a fraction of the time.
    text = lowered.compile(init_compiler_options()).as_text()
    ids = np.array([d.id for d in devices]).reshape(shape)
    return text, names, ids
