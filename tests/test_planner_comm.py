"""The planner's collectives per mesh axis equal the compiled program's, byte for byte: the
communication model (jddp/planner/comm.py, pipeline.py) against XLA's HLO (jddp/observe/hlo.py).
Eight
programs cover every axis, ZeRO's gathers and scatters, sequence parallelism, gradients reduced
in bfloat16, pipelines with the backward in one tick and in two, and a mixture of experts'
all-to-alls over the expert axis (dropless, capacity with its smaller blocks, and with the
experts and a shared expert split over tensor);
experiments/bench/planner.py --bytes checks every layout without stages that compiles on 8
devices (ddp and zero1 included). The same programs check the network model
(jddp/planner/network.py): the bytes each device sends across hosts of 2 and of 4 devices,
from the planner's collectives and its mesh arithmetic, equal those of the compiled ops, each
split by where its own replica groups' devices sit."""

import math

import numpy as np
import pytest

from experiments.bench.planner_programs import compiled_text, tiny_workload
from jddp.observe.hlo import bytes_by_axes, collective_ops
from jddp.planner import collective, comm, network
from jddp.planner.layouts import AXES, Layout

F32, BF16 = "float32", "bfloat16"
DROPLESS = {"num_experts": 8, "experts_per_token": 2}
# Each expert takes 16 of the 256 x 2 token-expert pairs: blocks of E/X x 16 rows, not tokens x k.
CAPACITY = DROPLESS | {"dispatch": "capacity", "capacity_factor": 0.25}
SHARED = DROPLESS | {"shared_expert_dim": 64}
CASES = [  # (layout, layers, micro-batches, gradients' dtype, moe); every other layout: --bytes
    (Layout("zero2", data=2, fsdp=2, tensor=2, sequence_parallel=True), 1, 0, F32, None),
    (Layout("zero3", data=2, fsdp=2, tensor=2), 1, 0, F32, None),
    # gradients reduce-scattered and their shards all-reduced in bfloat16, parameters float32
    (Layout("zero2", data=2, fsdp=4), 1, 0, BF16, None),
    # 1 layer per stage (the backward in one tick), the replicated parts summed over stages
    (Layout("zero1", data=2, stage=2), 2, 4, F32, None),
    # 2 layers per stage (the backward split in two ticks), zero3's gathers outside the loop
    (Layout("zero3", fsdp=2, stage=4), 8, 4, F32, None),
    # a mixture of experts: experts split over expert, their gradients not summed over it
    (Layout("zero3", expert=8), 1, 0, F32, DROPLESS),
    (Layout("zero3", expert=4, fsdp=2), 1, 0, F32, CAPACITY),
    # the experts' MLPs split over tensor (their outputs all-reduced as rows of token-expert
    # pairs), and a gated shared expert (sequence-parallel as the dense MLP)
    (Layout("zero3", expert=2, fsdp=2, tensor=2, sequence_parallel=True), 1, 0, F32, SHARED),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda case: f"{case[0].name} {case[3]}" + (" moe" if case[4] else "")
)
def test_modelled_bytes_per_axis_equal_the_compiled_hlo(case):
    layout, layers, microbatches, dtype, moe = case
    text, axis_names, device_ids = compiled_text(
        layout, layers=layers, microbatches=microbatches, grad_comm_dtype=dtype, moe=moe
    )
    compiled = bytes_by_axes(collective_ops(text), device_ids, axis_names)
    workload = tiny_workload(
        layers=layers, microbatches=microbatches, grad_comm_dtype=dtype, moe=moe
    )
    modelled = collective.bytes_by_axes(comm.step_collectives(workload, layout))
    assert compiled == modelled
    assert layout.tensor == 1 or ("tensor",) in {axes for axes, _ in compiled}
    assert layout.stage == 1 or (("stage",), "collective-permute") in compiled
    assert layout.expert == 1 or compiled[(("expert",), "all-to-all")] > 0

    collectives = comm.step_collectives(workload, layout)
    for per_host in (2, 4):
        planned = sum(
            c.count
            * network.bytes_across_hosts(
                network.op_phases(c.kind, c.nbytes, layout, c.axes, per_host)
            )
            for c in collectives
        )
        assert planned > 0 or layout.devices <= per_host  # one host: nothing crosses
        assert planned == pytest.approx(
            hlo_bytes_across_hosts(text, axis_names, device_ids, layout, per_host), rel=1e-12
        )


def hlo_bytes_across_hosts(text, axis_names, device_ids, layout, per_host) -> float:
    """Bytes one device sends across hosts of `per_host` devices in the compiled step: each op
    (scalars skipped, as bytes_by_axes skips them) split by its own first replica group (a
    collective-permute by its slowest pair: the step waits for it), the devices numbered as the
    planner lays a mesh out (its axis order, the last fastest)."""
    strides = {a: math.prod(layout.sizes[b] for b in AXES[i + 1 :]) for i, a in enumerate(AXES)}
    position = {
        int(d): sum(i * strides[axis_names[k]] for k, i in enumerate(index))
        for index, d in np.ndenumerate(device_ids)
    }
    total = 0.0
    for op in collective_ops(text):
        result = sum(b for b in op.sizes if b >= 5)
        if not result:
            continue
        group = op.groups[0] if op.groups else tuple(position)
        hosts = max(len({position[d] // per_host for d in g}) for g in op.groups or [group])
        if op.kind != "collective-permute":
            hosts = len({position[d] // per_host for d in group})
        volume = result * len(group) if op.kind == "reduce-scatter" else result
        rings = network.phases(op.kind, volume, len(group) // hosts, hosts)
        total += op.executions * network.bytes_across_hosts(rings)
    return total
