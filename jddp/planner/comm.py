"""The collectives one training step runs, per mesh axis: what each strategy communicates
(jddp/parallel/zero.py, ddp.py; what XLA picks for `auto`: jddp/planner/auto.py) and what tensor
parallelism adds (jddp/models/gpt.py), written out op by op. The byte totals per (axes, kind)
equal those read from the compiled HLO (jddp/observe/hlo.py `bytes_by_axes`), exactly, on every
mesh that compiles on 8 simulated devices (tests/test_planner_comm.py; all of them:
experiments/bench/planner.py; `auto`: tests/test_planner_auto.py).

Bytes are per device, counted as the HLO counts them: the result of each op (an all-gather's
whole array, a reduce-scatter's shard, an all-reduce's buffer, an all-to-all's array). Scalars
(metrics, norms) are left out, as `bytes_by_axes` leaves them out.

The context axis (jddp/parallel/context.py) is a batch axis for the gradients (they are averaged
over it as over data) and adds its attention's collectives (`context_collectives`). The expert
axis is a batch axis to every parameter but a mixture of experts' experts, which are split over
it (their gradients are summed over the other batch axes only); its all-to-alls and the
experts' token counts are `moe_collectives`.
"""

import dataclasses
import functools
import math

from jddp.models.moe_dispatch import all_to_all_bytes, dispatch_slots
from jddp.planner.auto import auto_collectives
from jddp.planner.collective import BACKWARD, CRITICAL, FORWARD, UPDATE, Collective, merged
from jddp.planner.layouts import Layout
from jddp.planner.shards import RULE_AXES, param_shards
from jddp.planner.stages import microbatches, stage_collectives
from jddp.planner.workload import SEQUENCE_SPLIT_PARAMS, Workload

BATCH_AXES = ("data", "expert", "fsdp")  # the batch axes a MoE layer's counts are summed over


def shares(layout: Layout) -> int:
    """Into how many shares the global batch's tokens are split: its rows over the batch axes,
    their sequences over context."""
    return layout.batch_slices * layout.context


def _axes(layout: Layout, *names: str) -> tuple[str, ...]:
    """The axes among `names` that the layout has (size > 1), in mesh order."""
    return tuple(a for a in names if layout.sizes[a] > 1)


def gradient_collectives(workload: Workload, layout: Layout) -> list[Collective]:
    """The ZeRO stage's (or ddp's) per-parameter collectives: gathers of parameters and
    reductions of gradients over the batch axes (equal ones merged)."""
    # The data axis's size does not change what is sent, only whether it is there.
    key = dataclasses.replace(
        layout,
        data=min(layout.data, 2),
        context=min(layout.context, 2),
        context_attention="ring",
        sequence_parallel=False,
    )
    return list(_gradient_collectives(workload, key))


@functools.lru_cache(maxsize=4096)
def _gradient_collectives(workload: Workload, layout: Layout) -> tuple[Collective, ...]:
    # Gradients are averaged over context as over data: its ranks hold the same rows.
    batch = _axes(layout, "data", "expert", "fsdp", "context")
    if layout.strategy == "ddp":
        batch = _axes(layout, "data")
    fsdp, replicas, tensor = layout.fsdp, _axes(layout, "data", "expert", "context"), layout.tensor
    # With accumulation XLA hoists zero3's gathers out of the micro-batch loop (loop-invariant)
    # while each micro-batch's reduce-scatter (the gather's transpose) stays in it (HLO).
    accum = workload.grad_accum_steps
    gathers = 2 if workload.regather_in_backward else 1
    out = []

    def add(kind, axes, nbytes, count, phase, what):
        if axes and nbytes:
            out.append(Collective(kind, axes, nbytes, count, phase, what))

    def reduce(kind, axes, nbytes, count, what):  # a gradient reduction
        if not workload.grad_comm_bytes:
            return add(kind, axes, nbytes, count, BACKWARD, what)
        # bfloat16 crosses as bit patterns (jddp/parallel/grad_reduction.py): an all-to-all of
        # the whole gradient and a float32 sum of the slice each device keeps ...
        if kind == "reduce-scatter":  # (`nbytes` is that slice)
            whole = nbytes * math.prod(layout.sizes[a] for a in axes)
            return add("all-to-all", axes, whole, count, BACKWARD, what)
        add("all-to-all", axes, nbytes, count, BACKWARD, what)
        add("all-gather", axes, nbytes, count, BACKWARD, what)  # ... and an all-reduce's gather

    for p in param_shards(workload, layout):
        # One tensor (and expert) rank's part, in the dtype that crosses the wire.
        wire = workload.comm_bytes or p.itemsize
        split = p.split(layout.sizes, RULE_AXES)
        b = p.elements * wire // split
        g = p.elements * (workload.grad_comm_bytes or wire) // split  # reduced gradients
        sharded = layout.strategy != "ddp" and layout.fsdp > 1 and p.split_over("fsdp")
        # An expert's gradient holds every token sent to it over expert: not summed over it.
        summed = tuple(a for a in batch if not p.split_over(a))
        data = tuple(a for a in replicas if not p.split_over(a))
        # A frozen parameter (LoRA's base) has no gradient to reduce and no update to gather.
        if p.trains and (layout.strategy in ("ddp", "zero1") or not sharded):
            reduce("all-reduce", summed, g, 1, "gradients")
        elif p.trains:  # zero2, zero3: reduce-scatter over fsdp, then the shards over data
            count = accum if layout.strategy == "zero3" else 1
            reduce("reduce-scatter", ("fsdp",), g // fsdp, count, "gradients")
            reduce("all-reduce", data, g // fsdp, 1, "gradient shards")
        if sharded and layout.strategy == "zero3":
            add("all-gather", ("fsdp",), b, gathers, FORWARD, "parameters")
        elif sharded and p.trains:  # zero1, zero2: the updated parameters, from the update
            add("all-gather", ("fsdp",), b, 1, UPDATE, "updated parameters")
        zero3_tensor = layout.strategy == "zero3" and tensor > 1
        if zero3_tensor and p.trains and not p.split_over("tensor"):
            # XLA computes these gradients from partial sums over tensor and reduces them
            # (seen in every zero3 program with a tensor axis; not under zero1 / zero2).
            add("all-reduce", ("tensor",), b // (fsdp if sharded else 1), 1, BACKWARD, "grads")
    return tuple(merged(out))


def tensor_collectives(workload: Workload, layout: Layout) -> list[Collective]:
    """Megatron's activation collectives over tensor for one step (4 per layer and micro-batch:
    2 forward, 2 backward, plus those of the recomputed forward; one more each way for the
    vocabulary-parallel embedding and head), with sequence parallelism as all-gather /
    reduce-scatter pairs; and what the vocabulary-parallel loss reduces. Activations are
    counted in the compute dtype (XLA:CPU reduces bfloat16 matmuls' partial sums in float32:
    the compiled CPU program moves twice these bytes)."""
    t = workload.transformer
    if layout.tensor == 1 or t is None:
        return []
    tensor = ("tensor",)
    micro_steps = workload.grad_accum_steps * microbatches(workload, layout)
    rows = workload.global_batch // (layout.batch_slices * micro_steps)
    tokens_held = t.seq_len // layout.context  # a context rank's share of each sequence
    activation = rows * tokens_held * t.width * workload.compute_bytes
    layers = t.layers // layout.stage
    per_pass = t.tensor_reductions_per_layer() * layers
    # A recomputed layer repeats its forward reductions; XLA drops the last one, whose result
    # only the next layer reads (seen in the HLO); PyTorch's checkpointing reruns them all.
    recomputed = per_pass - (layers if workload.recompute_drops_output else 0)
    count = 2 * per_pass + workload.recompute * recomputed + 2  # + embedding fwd, head bwd
    out = []
    if t.moe:  # the MLP's reductions (forward, backward): all-reduces of the experts' rows
        count -= 2 * layers
        rows_held = t.expert_rows(rows * tokens_held, layout.expert, shares(layout))
        outputs = rows_held * t.width * workload.compute_bytes
        mlp = 2 * layers * micro_steps
        out.append(Collective("all-reduce", tensor, outputs, mlp, CRITICAL, "expert outputs"))
        out += shared_expert_collectives(workload, layout, activation, layers * micro_steps)
    count *= micro_steps
    if layout.sequence_parallel:  # a recomputed layer gathers all its inputs again
        gathers = (2 * per_pass + workload.recompute * per_pass + 2) * micro_steps
        out.append(Collective("all-gather", tensor, activation, gathers, CRITICAL, "activations"))
        rs = activation / layout.tensor
        out.append(Collective("reduce-scatter", tensor, rs, count, CRITICAL, "activations"))
        for p in param_shards(workload, layout):
            if SEQUENCE_SPLIT_PARAMS.search(p.path):  # their gradients are partial sums
                out.append(Collective("all-reduce", tensor, p.nbytes, 1, BACKWARD, "norms"))
            elif p.path == "position_embed":  # each rank holds its positions' gradient
                out.append(Collective("all-gather", tensor, p.nbytes, 1, BACKWARD, "positions"))
                if layout.context > 1:  # and a rank's positions (int32), which it looks up
                    indices = 4 * tokens_held
                    out.append(Collective("all-gather", tensor, indices, 1, BACKWARD, "positions"))
    else:
        out.append(Collective("all-reduce", tensor, activation, count, CRITICAL, "activations"))
    if workload.vocab_parallel_loss:
        tokens = rows * tokens_held * 4  # float32 per token
        # logsumexp's max and sum, the target's logit; the accuracy's arg-max (value, index)
        out.append(Collective("all-reduce", tensor, tokens, 3 * micro_steps, CRITICAL, "loss"))
        gathered = tokens * layout.tensor
        out.append(Collective("all-gather", tensor, gathered, 2 * micro_steps, CRITICAL, "loss"))
    return out


def shared_expert_collectives(
    workload: Workload, layout: Layout, activation: float, layers: int
) -> list[Collective]:
    """Over tensor, a mixture of experts' shared expert (the model's dense MLP on the block's
    input) in `layers` layer passes: its two reductions of `activation`; with sequence
    parallelism three gathers and two reduce-scatters, and its gate's gradient summed (its
    input is split along the sequence). As seen in the compiled HLO of a gated shared expert."""
    moe = workload.transformer.moe
    if not moe.shared_expert_dim:
        return []
    tensor = ("tensor",)
    if not layout.sequence_parallel:
        return [Collective("all-reduce", tensor, activation, 2 * layers, CRITICAL, "shared")]
    split = activation / layout.tensor
    out = [
        Collective("all-gather", tensor, activation, 3 * layers, CRITICAL, "shared"),
        Collective("reduce-scatter", tensor, split, 2 * layers, CRITICAL, "shared"),
    ]
    for p in param_shards(workload, layout):
        if p.path.endswith("/shared_expert_gate"):
            out.append(Collective("all-reduce", tensor, p.nbytes, 1, BACKWARD, "shared gate"))
    return out


# The ring's messages (jddp/planner/timing.py hides a hop's behind that hop's compute).
RING_FORWARD, RING_BACKWARD, RING_HOME = "ring hops", "ring hops backward", "ring home"


def context_collectives(workload: Workload, layout: Layout) -> list[Collective]:
    """The context axis's attention collectives for one step (none without one). Keys and values
    cross in float32 (context attention computes in float32); a block is a rank's rows x
    2n = L / C tokens x its key/value width (kv heads x head size, split over tensor):

    ring        per layer, forward C - 1 hops of one message (k, v: 2 blocks); backward C - 1
                hops of (k, v, dk, dv: 4 blocks) and one hop home of (dk, dv): 6 (C - 1) + 2
                blocks per layer (jddp/parallel/context.py sends each hop's arrays as one
                message, so XLA cannot merge the backward's hops with the forward's)
    all_gather  per layer, forward k and v gathered whole (L tokens); backward their gradients
                reduce-scattered back to the rank's blocks

    A recomputed (remat) layer runs its forward's hops again. All are on the critical path
    here; timing.py hides each ring hop behind that hop's attention compute."""
    t = workload.transformer
    if layout.context == 1 or t is None:
        return []
    micro_steps = workload.grad_accum_steps * microbatches(workload, layout)
    rows = workload.global_batch // (layout.batch_slices * micro_steps)
    kv_width = (t.kv_heads or t.heads) * t.head_dim // layout.tensor
    block = rows * (t.seq_len // layout.context) * kv_width * 4
    layers = t.layers // layout.stage * micro_steps
    forwards = 1 + workload.recompute
    c, axes = layout.context, ("context",)
    if layout.context_attention == "all_gather":
        return [
            Collective("all-gather", axes, block * c, 2 * layers * forwards, CRITICAL, "keys"),
            Collective("reduce-scatter", axes, block, 2 * layers, CRITICAL, "key grads"),
        ]
    permute = "collective-permute"
    return [
        Collective(permute, axes, 2 * block, (c - 1) * layers * forwards, CRITICAL, RING_FORWARD),
        Collective(permute, axes, 4 * block, (c - 1) * layers, CRITICAL, RING_BACKWARD),
        Collective(permute, axes, 2 * block, layers, CRITICAL, RING_HOME),
    ]


def moe_collectives(workload: Workload, layout: Layout) -> list[Collective]:
    """A mixture of experts' collectives for one step (none without one): per MoE layer and
    micro-batch, the all-reduce that gives every device the global batch's token count per
    expert (int32, one row per batch slice: jddp/models/moe.py `every_device`), and over the
    expert axis the all-to-alls that send token-expert pairs to their experts' devices and the
    outputs back, forward and backward (jddp/models/moe_dispatch.py `all_to_all_bytes`)."""
    t = workload.transformer
    if t is None or t.moe is None:
        return []
    micro_steps = workload.grad_accum_steps * microbatches(workload, layout)
    slices = shares(layout)
    rows = workload.global_batch // (layout.batch_slices * micro_steps)
    layers = t.layers // layout.stage * micro_steps
    batch = _axes(layout, "data") if layout.strategy == "ddp" else _axes(layout, *BATCH_AXES)
    out = []
    experts = t.moe.num_experts
    if batch:
        counts = layout.batch_slices * experts * 4
        out.append(Collective("all-reduce", batch, counts, layers, CRITICAL, "expert counts"))
    if layout.context > 1:  # whole sequences' experts (int32), then each rank's kept counts
        choices = rows * t.seq_len * t.moe.experts_per_token * 4
        out.append(Collective("all-gather", ("context",), choices, layers, CRITICAL, "choices"))
        kept = (*batch, "context")
        out.append(Collective("all-reduce", kept, slices * experts * 4, layers, CRITICAL, "kept"))
    if layout.expert > 1:
        tokens = rows * t.seq_len // layout.context
        moved = all_to_all_bytes(
            t.moe,
            tokens_per_device=tokens,
            batch_slices=slices,
            embed_dim=t.width,
            expert_size=layout.expert,
            dtype_bytes=workload.compute_bytes,
            remat=bool(workload.recompute),
        )
        # One op: a block of `dispatch_slots` rows to each device of the axis.
        slots = dispatch_slots(t.moe, tokens, tokens * slices, layout.expert)
        block = layout.expert * slots * t.width * workload.compute_bytes
        ops = moved // block * layers
        out.append(Collective("all-to-all", ("expert",), block, ops, CRITICAL, "tokens"))
    return out


def step_collectives(
    workload: Workload, layout: Layout, partitioner_reduce_scatter: bool = True
) -> list[Collective]:
    """Every collective of one training step of `workload` under `layout`;
    `partitioner_reduce_scatter=False`: as XLA:CPU lowers the sums `auto` leaves to the
    compiler (jddp/planner/auto.py; the other strategies write theirs by hand)."""
    if layout.strategy == "auto":
        own = auto_collectives(workload, layout, partitioner_reduce_scatter)
        return own + tensor_collectives(workload, layout)
    return (
        gradient_collectives(workload, layout)
        + tensor_collectives(workload, layout)
        + stage_collectives(workload, layout)
        + context_collectives(workload, layout)
        + moe_collectives(workload, layout)
    )
