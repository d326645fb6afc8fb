"""The planner's collectives per mesh axis equal the compiled program's, byte for byte: the
communication model (jddp/planner/comm.py, pipeline.py) against XLA's HLO (jddp/observe/hlo.py).
Five
programs cover every axis, ZeRO's gathers and scatters, sequence parallelism, gradients reduced
in bfloat16, and pipelines with the backward in one tick and in two;
experiments/bench/planner.py --bytes checks every layout without stages that compiles on 8
devices (ddp and zero1 included)."""

import pytest

from experiments.bench.planner_programs import compiled_text, tiny_workload
from jddp.observe.hlo import bytes_by_axes, collective_ops
from jddp.planner import collective, comm
from jddp.planner.layouts import Layout

F32, BF16 = "float32", "bfloat16"
CASES = [  # (layout, layers, micro-batches, gradients' dtype); every other layout: --bytes
    (Layout("zero2", data=2, fsdp=2, tensor=2, sequence_parallel=True), 1, 0, F32),
    (Layout("zero3", data=2, fsdp=2, tensor=2), 1, 0, F32),
    # gradients reduce-scattered and their shards all-reduced in bfloat16, parameters float32
    (Layout("zero2", data=2, fsdp=4), 1, 0, BF16),
    # 1 layer per stage (the backward in one tick), the replicated parts summed over stages
    (Layout("zero1", data=2, stage=2), 2, 4, F32),
    # 2 layers per stage (the backward split in two ticks), zero3's gathers outside the loop
    (Layout("zero3", fsdp=2, stage=4), 8, 4, F32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0].name} {case[3]}")
def test_modelled_bytes_per_axis_equal_the_compiled_hlo(case):
    layout, layers, microbatches, dtype = case
    text, axis_names, device_ids = compiled_text(
        layout, layers=layers, microbatches=microbatches, grad_comm_dtype=dtype
    )
    compiled = bytes_by_axes(collective_ops(text), device_ids, axis_names)
    workload = tiny_workload(layers=layers, microbatches=microbatches, grad_comm_dtype=dtype)
    modelled = collective.bytes_by_axes(comm.step_collectives(workload, layout))
    assert compiled == modelled
    assert layout.tensor == 1 or ("tensor",) in {axes for axes, _ in compiled}
    assert layout.stage == 1 or (("stage",), "collective-permute") in compiled
