"""LoRA's frozen base carries no gradient: the compiled step's gradient collectives move the
adapters' bytes alone (against sizes computed here, and equal to the planner's model), and the
planner's memory counts gradients and optimizer state for the adapters alone. The tiny GPT of
tests/test_planner_comm.py, with adapters of rank 2 on every projection (the default targets)."""

import jax
import pytest

import jddp
from experiments.bench.planner_programs import compiled_text, tiny_workload
from jddp.core import lora
from jddp.observe.hlo import bytes_by_axes, collective_ops
from jddp.planner import collective, comm, memory_model
from jddp.planner.layouts import Layout

LORA = jddp.LoRA(rank=2)


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "layout,layers,microbatches",
    [
        (Layout("ddp", data=8), 1, 0),
        (Layout("zero3", data=2, fsdp=2, tensor=2), 1, 0),
        (Layout("zero3", fsdp=4, stage=2), 2, 2),
    ],
    ids=lambda case: case.name if isinstance(case, Layout) else str(case),
)
def test_gradient_collectives_move_the_adapters_alone(layout, layers, microbatches):
    text, axis_names, device_ids = compiled_text(
        layout, layers=layers, microbatches=microbatches, lora=LORA
    )
    compiled = bytes_by_axes(collective_ops(text), device_ids, axis_names)
    workload = tiny_workload(layers=layers, microbatches=microbatches, lora=LORA)
    modelled = collective.bytes_by_axes(comm.step_collectives(workload, layout))
    base, adapters = lora.split(workload.params)
    adapter_bytes = _bytes(adapters)  # float32; every adapter splits over fsdp (min size 1)
    assert adapter_bytes * 10 < _bytes(base)
    if layout.strategy == "ddp":  # one all-reduce of the adapters' gradients
        assert compiled == {(("data",), "all-reduce"): adapter_bytes} == modelled
    elif layout.stage == 1:  # reduce-scattered over fsdp, the shards all-reduced over data
        gradients = {(("fsdp",), "reduce-scatter"), (("data",), "all-reduce")}
        assert {key: compiled[key] for key in gradients} == dict.fromkeys(
            gradients, adapter_bytes // 2
        )
        # The adapters' activations over tensor are XLA's choice, which the planner does not
        # model: every other axis equals it.
        assert {k: v for k, v in compiled.items() if k[0] != ("tensor",)} == {
            k: v for k, v in modelled.items() if k[0] != ("tensor",)
        }
    else:  # a stage's layer's adapters reduce-scattered over fsdp; nothing summed over stages
        assert compiled[(("fsdp",), "reduce-scatter")] == adapter_bytes // 2 // 4
        assert not any(kind == "all-reduce" for _, kind in compiled)
        assert compiled == modelled


def test_the_planner_counts_gradients_and_optimizer_state_for_the_adapters_alone():
    full, adapted = tiny_workload(), tiny_workload(lora=LORA)
    base, adapters = lora.split(adapted.params)
    base_bytes, adapter_bytes = _bytes(base), _bytes(adapters)
    assert base_bytes == _bytes(full.params)
    ddp, zero3 = Layout("ddp", data=8), Layout("zero3", fsdp=8)
    without, with_lora = (memory_model.state_bytes(w, ddp) for w in (full, adapted))
    assert (without.params, without.grads) == (base_bytes, base_bytes)
    assert with_lora.params == base_bytes + adapter_bytes
    assert with_lora.grads == adapter_bytes
    assert with_lora.optimizer == 2 * adapter_bytes + 4  # AdamW's moments and step (int32)
    # zero3 over 8: every adapter's largest dimension divides by 8
    without, with_lora = (memory_model.state_bytes(w, zero3) for w in (full, adapted))
    assert with_lora.grads == adapter_bytes // 8 < without.grads
    assert with_lora.optimizer == 2 * adapter_bytes // 8 + 4
    for workload, grads in [(full, base_bytes), (adapted, adapter_bytes)]:  # ddp's all-reduce
        modelled = collective.bytes_by_axes(comm.step_collectives(workload, ddp))
        assert modelled == {(("data",), "all-reduce"): grads}
