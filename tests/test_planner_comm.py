"""The planner's collectives per mesh axis equal the compiled program's, byte for byte: the
communication model (jddp/planner/comm.py, pipeline.py) against XLA's HLO (jddp/hlo.py). Four
programs cover every axis, ZeRO's gathers and scatters, sequence parallelism, and pipelines with
the backward in one tick and in two; experiments/bench/planner.py --bytes checks every layout
without stages that compiles on 8 devices (ddp and zero1 included)."""

import pytest

from jddp.hlo import bytes_by_axes, collective_ops
from jddp.planner import comm
from jddp.planner.layouts import Layout
from tests.planner_programs import compiled_text, tiny_workload

CASES = [  # (layout, layers, micro-batches); every other layout: the benchmark's --bytes
    (Layout("zero2", data=2, fsdp=2, tensor=2, sequence_parallel=True), 1, 0),
    (Layout("zero3", data=2, fsdp=2, tensor=2), 1, 0),
    # 1 layer per stage (the backward in one tick), the replicated parts summed over stages
    (Layout("zero1", data=2, stage=2), 2, 4),
    # 2 layers per stage (the backward split in two ticks), zero3's gathers outside the loop
    (Layout("zero3", fsdp=2, stage=4), 8, 4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case[0].name)
def test_modelled_bytes_per_axis_equal_the_compiled_hlo(case):
    layout, layers, microbatches = case
    text, axis_names, device_ids = compiled_text(layout, layers=layers, microbatches=microbatches)
    compiled = bytes_by_axes(collective_ops(text), device_ids, axis_names)
    workload = tiny_workload(layers=layers, microbatches=microbatches)
    modelled = comm.bytes_by_axes(comm.step_collectives(workload, layout))
    assert compiled == modelled
    assert layout.tensor == 1 or ("tensor",) in {axes for axes, _ in compiled}
    assert layout.stage == 1 or (("stage",), "collective-permute") in compiled
