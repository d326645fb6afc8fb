"""A step's predicted time: compute, exposed communication per mesh axis, pipeline bubble.

compute     executed FLOPs per device (model FLOPs, plus the recomputed forward with remat)
            / (peak x efficiency), slower where the profile measured narrow matmuls to be
            (`shape_slowdown`: a tensor split narrows a small model's projections); plus the
            memory traffic of the non-matmul ops (norms, residual adds, activations,
            softmax, dropout: jddp/planner/workload.py) / memory bandwidth, with (on a
            profile without a measured shape curve) the attention scores that unfused
            attention's matmuls write and read: matmuls of head-size FLOPs per byte, at
            memory speed; what makes a narrow model's step slower per FLOP than a wide one's;
            the optimizer update as memory traffic / bandwidth
overlap     each collective by when it runs (jddp/planner/collective.py phases):
              forward   zero3's parameter gathers (and those XLA picks under `auto`),
                        hidden under the forward's compute
              backward  gradient reductions, hidden under the backward's compute
              critical  tensor-parallel activations, stage sends, the activations `auto`'s
                        compiler moves instead of weights: nothing hides them
              update    zero1/2's gathers of updated parameters, after the step's compute
            a phase's exposed time is max(its time / layers, its time - the compute it can
            hide under): all but one layer's share can overlap. On devices without async
            collectives (`overlap=False`, the CPU) everything is exposed, as it is for the
            axes a workload names in `exposed_axes`.
bubble      compute and critical communication run inside the pipeline, so its idle share
            b (jddp/planner/stages.py) stretches them by b / (1 - b); on simulated devices
            sharing a machine's cores (`shared_compute`) an idle stage's ticks do no work and
            its cores serve the busy stages, so the bubble costs nothing there (stage:4's
            step is 3-18% slower than stage:2's in experiments/bench/planner.py, where a
            costed bubble would give 1.4x), and the stages' stacked layers cost the
            profile's `stacked_layers_slowdown`
context     the ring's hops (jddp/planner/comm.py) run inside each layer's attention: a hop's
            transfer hides behind the attention compute of the block the rank already holds
            (half a diagonal block with the balanced layout: b x 2n x n x heads x head size
            multiply-adds twice forward, 2.5 times that backward), so each hop shows
            max(0, transfer - compute); the backward's last hop home has nothing to hide
            under. all_gather's gather and scatter are critical. Without async collectives
            every hop is exposed.
slowest     the hosts (a TPU slice: its chips) joined over the inter-host network meet once a
            step, in the gradient reduction, and each waits there for the slowest: a step of
            P hosts is the mean step x (1 + spread x the expected maximum of P standard
            normals) (jddp/planner/network.py `slowest_of`; `step_spread`, the relative
            spread of one host's step, is the profile's: jddp/planner/devices.py). Inside a
            host the devices meet at every layer's collectives, so their spread is part of
            the measured efficiency
links       a group of devices inside one host uses the intra-host link, a group spanning
            hosts runs hierarchically (jddp/planner/network.py); except on XLA:CPU
            (`every_group_crosses_hosts`): in a job of several processes every group, even
            one process's own devices, rings over gloo
"""

import dataclasses
import math

from jddp.planner import comm
from jddp.planner.collective import BACKWARD, CRITICAL, FORWARD, UPDATE, Collective, merged
from jddp.planner.devices import DeviceProfile
from jddp.planner.layouts import Layout
from jddp.planner.memory_model import state_bytes
from jddp.planner.network import bytes_across_hosts, op_phases, phases_time, slowest_of
from jddp.planner.stages import bubble_fraction, microbatches
from jddp.planner.workload import Workload

COMBINE_BYTES = 32 * 2**20  # per combined collective (XLA's combiners default to ~30 MiB)


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float
    compute_s: float
    optimizer_s: float
    bubble_s: float
    exposed_s: dict[str, float]  # per mesh axis: communication time not hidden by compute
    comm_s: dict[str, float]  # per mesh axis: all communication time
    tokens_per_s: float
    mfu: float  # model FLOPs / (step x devices x peak)
    sync_s: float = 0.0  # waiting for the slowest of the hosts joined over the network
    bytes_across_hosts: float = 0.0  # one device's bytes over the inter-host network per step

    @property
    def exposed_total(self) -> float:
        return sum(self.exposed_s.values())


def _combined(collectives, profile: DeviceProfile) -> list[Collective]:
    """The ops that really run: XLA combines the per-parameter collectives of one kind, axes
    and phase into buckets of up to `COMBINE_BYTES` (its all-reduce / all-gather /
    reduce-scatter combiner passes; XLA:CPU runs only the all-reduce one), so their latency is
    paid per bucket, not per parameter. Activation collectives stay one op each."""
    out, groups = [], {}
    for c in merged(collectives):
        if c.phase == CRITICAL or c.kind not in profile.combined_kinds:
            out.append(c)
            continue
        key = (c.kind, c.axes, c.phase)
        total, what = groups.get(key, (0.0, c.what))
        groups[key] = (total + c.total, what)
    for (kind, axes, phase), (total, what) in groups.items():
        ops = math.ceil(total / COMBINE_BYTES)
        out.append(Collective(kind, axes, total / ops, ops, phase, what))
    return out


def peak_per_device(profile: DeviceProfile, workload: Workload, layout: Layout) -> float:
    peak = profile.peak_for(workload.compute_bytes)
    return peak / layout.devices if profile.shared_compute else peak


def shape_slowdown(workload: Workload, layout: Layout, profile: DeviceProfile) -> float:
    """How much slower the step's matmuls run than wide ones would on `profile`: their
    multiply-adds weighted by 1 / the rate of their smallest dimension (1 without a measured
    curve or without a transformer to take the shapes from)."""
    t = workload.transformer
    if t is None or not profile.matmul_shape_rates:
        return 1.0
    dims = t.matmul_dims(layout.tensor)
    return sum(m / profile.shape_rate(d) for m, d in dims) / sum(m for m, _ in dims)


def memory_traffic(workload: Workload, layout: Layout) -> tuple[float, float]:
    """(non-matmul ops, optimizer update): the bytes one device reads and writes per step, as
    the planner counts them: each element read and written once per op."""
    elementwise = workload.elementwise_bytes(  # a context rank holds 1 / C of the tokens
        layout.tensor, layout.sequence_parallel, layout.batch_slices * layout.context, layout.stage
    )
    state = state_bytes(workload, layout)
    return elementwise, 2 * (state.params + state.optimizer) + state.grads


def memory_bound_seconds(
    workload: Workload, layout: Layout, profile: DeviceProfile
) -> tuple[float, float]:
    """(non-matmul ops, optimizer update): one device's memory traffic per step over its
    memory bandwidth (simulated devices share the machine's: each gets 1 / devices of it). On
    a profile without a measured matmul-shape curve, the first includes the attention scores
    that unfused attention's matmuls write and read (`Workload.score_bytes`); a measured curve
    (`cpu`) already holds a narrow matmul's traffic in its rate."""
    bandwidth = profile.memory_bandwidth / (layout.devices if profile.shared_compute else 1)
    elementwise, optimizer = memory_traffic(workload, layout)
    if not profile.matmul_shape_rates:
        elementwise += workload.score_bytes(
            layout.tensor, layout.batch_slices * layout.context, layout.stage
        )
    return elementwise / bandwidth, optimizer / bandwidth


def predict(
    workload: Workload,
    layout: Layout,
    profile: DeviceProfile,
    devices_per_host: int,
    exposed_axes: tuple[str, ...] = (),
) -> Prediction:
    """The predicted step of `workload` under `layout` on `profile`'s devices."""
    if profile.every_group_crosses_hosts and layout.devices > devices_per_host:
        devices_per_host = 1  # every group rings over the inter-host link (gloo on XLA:CPU)
    peak = peak_per_device(profile, workload, layout)
    elementwise, optimizer = memory_bound_seconds(workload, layout, profile)
    compute = workload.hardware_flops() / layout.devices / (peak * profile.efficiency)
    compute = compute * shape_slowdown(workload, layout, profile) + elementwise
    if layout.stage > 1:  # the stages run their layers stacked, as one scan
        compute *= profile.stacked_layers_slowdown
    forward_share = 1 / (3 + workload.recompute)
    windows = {
        FORWARD: compute * forward_share,
        BACKWARD: compute * (1 - forward_share),
        CRITICAL: 0.0,
        UPDATE: 0.0,
    }

    hop_compute = ring_hop_seconds(workload, layout, peak * profile.efficiency)
    hidden_ring: dict[str, float] = {}  # axis -> ring seconds hidden behind the hops' compute
    times: dict[tuple[str, str], float] = {}  # (phase, axis) -> seconds
    ops: dict[str, float] = {}  # phase -> collectives run in it
    pipelined = 0.0  # critical communication inside each micro-batch's work
    across = 0.0  # bytes one device sends over the inter-host network
    collectives = comm.step_collectives(workload, layout, profile.partitioner_reduce_scatter)
    for c in _combined(collectives, profile):
        rings = op_phases(c.kind, c.nbytes, layout, c.axes, devices_per_host)
        seconds = c.count * phases_time(rings, *profile.links(c.kind))
        across += c.count * bytes_across_hosts(rings)
        phase = c.phase
        pipelined += seconds if phase == CRITICAL else 0.0
        if not profile.overlap or any(a in exposed_axes for a in c.axes):
            phase = CRITICAL
        elif c.what in hop_compute:  # each hop's message behind that hop's compute
            shown = c.count * max(0.0, seconds / c.count - hop_compute[c.what])
            axis = ",".join(c.axes)
            hidden_ring[axis] = hidden_ring.get(axis, 0.0) + seconds - shown
        key = (phase, ",".join(c.axes))
        times[key] = times.get(key, 0.0) + seconds
        ops[phase] = ops.get(phase, 0.0) + c.count

    exposed: dict[str, float] = {}
    total: dict[str, float] = {}
    for phase in windows:
        in_phase = {axis: s for (p, axis), s in times.items() if p == phase}
        phase_time = sum(in_phase.values())
        if not phase_time:
            continue
        if phase in (CRITICAL, UPDATE):
            hidden_share = 0.0
        else:
            shown = max(phase_time / ops[phase], phase_time - windows[phase])
            hidden_share = 1 - shown / phase_time
        for axis, seconds in in_phase.items():
            total[axis] = total.get(axis, 0.0) + seconds
            exposed[axis] = exposed.get(axis, 0.0) + seconds * (1 - hidden_share)

    for axis, seconds in hidden_ring.items():
        exposed[axis] -= seconds

    bubble = 0.0 if profile.shared_compute else bubble_fraction(workload, layout)
    bubble_s = (compute + pipelined) * bubble / (1 - bubble)
    step = compute + bubble_s + sum(exposed.values()) + optimizer
    sync = step * profile.step_spread * slowest_of(math.ceil(layout.devices / devices_per_host))
    step += sync
    peak_all = peak * layout.devices
    return Prediction(
        step_s=step,
        compute_s=compute,
        optimizer_s=optimizer,
        bubble_s=bubble_s,
        exposed_s=exposed,
        comm_s=total,
        tokens_per_s=workload.global_batch * workload.tokens_per_example / step,
        mfu=workload.model_flops / (step * peak_all),
        sync_s=sync,
        bytes_across_hosts=across,
    )


def ring_hop_seconds(workload: Workload, layout: Layout, rate: float) -> dict[str, float]:
    """{ring message name: seconds of attention compute one hop's message can hide behind} for
    `layout`'s context ring ({} without one): a hop's block is half a diagonal block (b x 2n x
    n scores per head, n = L / 2C), two matmuls forward (the scores, their product with the
    values), five backward (2.5 x); the hop home hides behind nothing."""
    t = workload.transformer
    if layout.context == 1 or layout.context_attention != "ring" or t is None:
        return {}
    micro_steps = workload.grad_accum_steps * microbatches(workload, layout)
    rows = workload.global_batch // (layout.batch_slices * micro_steps)
    n = t.seq_len // (2 * layout.context)
    forward = 2 * 2 * rows * 2 * n * n * t.attention_width / layout.tensor / rate
    return {comm.RING_FORWARD: forward, comm.RING_BACKWARD: 2.5 * forward}
