"""The planner's collectives per mesh axis equal the compiled program's, byte for byte: the
communication model (jddp/planner/comm.py) against XLA's HLO (jddp/hlo.py). Five programs cover
every strategy, every axis and sequence parallelism; experiments/bench/planner.py --bytes
checks every layout that compiles on 8 devices."""

import pytest

from jddp.hlo import bytes_by_axes, collective_ops
from jddp.planner import comm
from jddp.planner.layouts import Layout
from tests.planner_programs import compiled_text, tiny_workload

CASES = [
    Layout("ddp", data=8),
    Layout("zero1", data=2, fsdp=2, tensor=2),
    Layout("zero2", data=2, fsdp=2, tensor=2, sequence_parallel=True),
    Layout("zero3", data=2, fsdp=2, tensor=2),
    Layout("zero3", data=2, tensor=4, sequence_parallel=True),
]


@pytest.mark.parametrize("layout", CASES, ids=lambda layout: layout.name)
def test_modelled_bytes_per_axis_equal_the_compiled_hlo(layout):
    text, axis_names, device_ids = compiled_text(layout)
    compiled = bytes_by_axes(collective_ops(text), device_ids, axis_names)
    modelled = comm.bytes_by_axes(comm.step_collectives(tiny_workload(), layout))
    assert compiled == modelled
    assert ("tensor",) in {axes for axes, _ in compiled} or layout.tensor == 1
