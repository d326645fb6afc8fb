"""The planner on a mixture of experts, shapes only (its all-to-all bytes against the compiled
step: tests/test_planner_comm.py): FLOPs that count a token's k experts of E, the state each
device holds on an expert axis as the trainer lays it out, and layouts with an expert axis
planned and ranked for MoE models only."""

import jax
import numpy as np
import pytest

import jddp
from experiments.bench.planner_programs import tiny_model, tiny_workload
from experiments.bench.tiny_gpt import BATCH, SEQ, WIDTH, adamw, token_batches
from jddp.models.gpt import TENSOR_PARALLEL_RULES
from jddp.observe.flops import train_step_flops
from jddp.observe.memory import sharded_bytes
from jddp.parallel.rules import adapt_preset
from jddp.parallel.strategies import device_mesh_for
from jddp.planner import devices, search
from jddp.planner.layouts import Layout
from jddp.planner.memory_model import state_bytes
from jddp.run.objectives import OBJECTIVES

EXPERTS, K, EXPERT_DIM = 8, 2, 16
MOE = {"num_experts": EXPERTS, "experts_per_token": K, "expert_dim": EXPERT_DIM}


def test_moe_flops_count_the_experts_a_token_takes():
    tokens = np.zeros((BATCH, SEQ), np.int32)
    moe = train_step_flops(tiny_model(4, moe=MOE), tokens).per_step
    # The same model dense with compute matched: one MLP as wide as a token's k experts.
    dense = train_step_flops(tiny_model(4, mlp_dim=K * EXPERT_DIM), tokens).per_step
    router = 6 * BATCH * SEQ * WIDTH * EXPERTS  # per layer (one here): embed x experts
    assert moe == dense + router
    workload = tiny_workload(moe=MOE)
    assert workload.model_flops == moe  # MFU's numerator: the planner's and the run's agree
    assert workload.transformer.train_flops(BATCH) == moe


@pytest.mark.parametrize("layout", [Layout("zero3", expert=4, fsdp=2), Layout("zero1", expert=8)])
def test_state_bytes_per_device_are_the_trainers_on_an_expert_axis(layout):
    mesh = device_mesh_for(layout.strategy, layout.mesh_spec, jax.devices()[:8])
    trainer = jddp.Trainer(
        tiny_model(4, moe=MOE, batch_axis_name="batch", expert_axis="expert"),
        OBJECTIVES["language_model"].loss_fn,
        adamw(),
        input_key="inputs",
        strategy=layout.strategy,
        mesh=mesh,
        rules=adapt_preset(TENSOR_PARALLEL_RULES, mesh),
        min_shard_size=1,
    )
    state = trainer.abstract_state(token_batches(steps=1)[0])
    specs, grad_specs = trainer.strategy.layout()
    shape = {a: mesh.size(a) for a in mesh.axis_names}
    planned = state_bytes(tiny_workload(moe=MOE), layout)
    assert planned.params == sharded_bytes(state.params, specs.params, shape)
    assert planned.grads == sharded_bytes(state.params, grad_specs, shape)
    assert planned.optimizer == sharded_bytes(state.opt_state, specs.opt_state, shape)
    # The experts are split over expert under every ZeRO stage: less than fsdp alone holds.
    assert planned.params < state_bytes(tiny_workload(moe=MOE), Layout("zero1", fsdp=8)).params


def test_expert_layouts_are_planned_and_ranked_for_moe_models_only():
    profile = devices.PRESETS["h100"]
    rows, rejected = search.plan(tiny_workload(moe=MOE), 8, profile, 8)
    meshes = {r["layout"]: r for r in rows}
    assert {"zero3 expert:8", "zero3 expert:4,fsdp:2", "zero2 data:2,expert:2,fsdp:2"} <= set(
        meshes
    )
    expert_8 = meshes["zero3 expert:8"]
    assert expert_8["mesh"]["expert"] == 8 and expert_8["comm_s"]["expert"] > 0
    # The experts' weights are E / 8 per device there; activations hold the dispatch blocks.
    assert expert_8["state_bytes"]["params"] < meshes["ddp batch:8"]["state_bytes"]["params"]
    assert {"zero3 expert:2,fsdp:2,tensor:2 +sp", "zero3 expert:2,fsdp:2,context:2"} <= set(meshes)
    # MoE runs in pipelines: a stage layout is refused only for the tiny model's one layer.
    assert "1 layers do not split" in rejected["zero3 stage:2,expert:4"]
    dense_rows, dense_rejected = search.plan(tiny_workload(), 8, profile, 8)
    assert not any("expert" in r["layout"] for r in dense_rows)
    assert not any("expert" in name for name in dense_rejected)
