"""Bytes one device holds: the training state exactly (shapes and partition rules, as
jddp/observe/memory.py `sharded_bytes` counts them), activations analytically for transformers.

Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4; 16-bit activations, b rows of s tokens, width h, a heads,
tensor size t): s b h (34 + 5 a s / h) bytes without tensor parallelism, s b h (10 + 24/t +
5 a s / (h t)) with it, s b h (34 + 5 a s / h) / t with sequence parallelism; 2 s b h with
every layer recomputed (only the layer's input is kept) plus one layer's worth while it is
recomputed, once (any recomputation is planned this way: only layer inputs are kept). Scaled by
bytes per activation / 2; the float32 logits (and their gradient) added.

A pipeline's stages keep what `parallel.pipeline.remat` says: `none` as above; `full` only each
layer's input, as with recompute; `dots` (the default) the layer's input and the matmuls'
outputs, s b h (4 + 16/t + 2 a s / (h t)) (the input and the out-projection's output whole over
tensor; the query/key/value, scores, attention output and MLP's first matmul split; measured for
jddp's GPT block: tests/test_pipeline.py), plus one layer's whole activations while its backward
recomputes the rest.

With a context axis of size C each device holds s / C of every sequence's tokens (s above becomes
s / C), and attention (jddp/parallel/context.py) keeps instead of the s x s probabilities:
    ring        the diagonal block's scores (s/C x s/C: the term 5 a s / h with s / C keys);
                its remote blocks are in flight one at a time, not kept: one backward message
                (keys, values and their gradients: 4 x b x s/C x kv width, float32) once
    all_gather  the s/C x s scores (5 a s / h with s keys) and the whole sequence's keys and
                values per layer (2 x b x s x kv width, float32)
Parameters, gradients and optimizer state are replicated over context: they do not shrink.

A mixture of experts' layer keeps, in place of the dense MLP's 16 s b h / t (its hidden units at
4h), the rows its experts multiply (k per token; on an expert axis the padded blocks the
all-to-all delivers: X x `dispatch_slots`, jddp/models/moe_dispatch.py) and their hidden units
(two per unit, three gated; split over tensor), each pair's output, the shared expert's hidden
units and the router's float32 logits and probabilities. Its experts are split over the expert
axis (and under zero3 over fsdp too, as the rules say): each device holds E / X of them.
"""

import dataclasses
import functools

from jddp.planner import auto
from jddp.planner.layouts import SPLIT_PARAMS, Layout
from jddp.planner.shards import (
    RULE_AXES,
    all_shards,
    on_first_stage,
    optimizer_table,
    param_shards,
)
from jddp.planner.stages import microbatches
from jddp.planner.workload import Workload


@dataclasses.dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(workload: Workload, layout: Layout) -> StateBytes:
    """Parameters, averaged gradients and optimizer state held by one device of the first
    (most loaded) pipeline stage, as jddp/planner/shards.py lays each out (frozen parameters,
    LoRA's base, have neither gradient nor optimizer state)."""
    key = Layout(
        layout.strategy,
        fsdp=layout.fsdp,
        tensor=layout.tensor,
        stage=layout.stage,
        expert=layout.expert,
    )
    return _state_bytes(workload, key)


@functools.lru_cache(maxsize=4096)
def _state_bytes(workload: Workload, layout: Layout) -> StateBytes:
    shards = all_shards(workload, layout)
    sizes = layout.sizes
    params = grads = 0
    for p in shards:
        if on_first_stage(p, workload, layout.stage):
            whole_over_fsdp = p.nbytes // p.split(sizes, RULE_AXES)
            split_params = layout.strategy in SPLIT_PARAMS
            params += p.nbytes // p.split(sizes) if split_params else whole_over_fsdp
            if not p.trains:  # frozen (LoRA's base): no gradient
                continue
            grads += (
                p.nbytes // p.split(sizes)
                if layout.strategy in ("zero2", *SPLIT_PARAMS)
                else whole_over_fsdp
            )
    optimizer = 0
    for index, nbytes in optimizer_table(workload):
        if index is None:  # step counts, scalars: replicated
            optimizer += nbytes
        elif on_first_stage(shards[index], workload, layout.stage):
            optimizer += nbytes // shards[index].split(sizes)
    return StateBytes(params, grads, optimizer)


def activation_bytes(workload: Workload, layout: Layout) -> int | None:
    """Activations one device keeps for the backward pass (None: not a transformer)."""
    t = workload.transformer
    if t is None:
        return None
    if layout.strategy == "auto" and auto.feature_split(workload, layout):
        layout = dataclasses.replace(layout, fsdp=1)  # the batch whole over fsdp
    m = microbatches(workload, layout) * workload.grad_accum_steps
    rows = workload.global_batch // (layout.batch_slices * m)
    tokens = t.seq_len // layout.context  # a context rank's share of each sequence
    sbh = tokens * rows * t.width
    keys = t.seq_len  # how many keys each query's kept probabilities span
    if layout.context > 1 and layout.context_attention == "ring":
        keys = tokens
    scores = 0 if t.fused_attention else t.heads * keys / t.width  # a s / h
    per_layer = _per_layer(sbh, 10, 24, 5 * scores, layout) * workload.compute_bytes / 2
    per_layer += moe_layer_bytes(workload, layout, tokens * rows)
    gathered_kv, ring_message = context_kv_bytes(workload, layout, rows)
    per_layer += gathered_kv
    layers = t.layers // layout.stage
    in_flight = min(m, layout.stage)  # 1F1B: the first stage holds S micro-batches
    tensor = layout.tensor
    if workload.recompute:  # only each layer's input is kept (split over tensor with SP);
        # one layer's activations exist while it is recomputed, for one micro-batch at a time
        kept_input = sbh * workload.compute_bytes / (tensor if layout.sequence_parallel else 1)
        kept = layers * kept_input * in_flight + per_layer
    elif layout.stage > 1 and workload.pipeline_remat == "dots":  # the matmuls' outputs, and
        # the rest of one layer's while its backward recomputes them
        dots = _per_layer(sbh, 4, 16, 2 * scores, layout) * workload.compute_bytes / 2
        kept = layers * (dots + gathered_kv) * in_flight + per_layer
    else:
        kept = layers * per_layer * in_flight
    logits = 2 * rows * tokens * t.vocab / tensor * 4
    return int(kept + ring_message + logits)


def moe_layer_bytes(workload: Workload, layout: Layout, tokens: int) -> float:
    """What a mixture of experts' layer keeps for the backward on a device holding `tokens`
    tokens, less the dense MLP's hidden units the per-layer formula counts (0 without one)."""
    t = workload.transformer
    moe = t.moe
    if moe is None:
        return 0.0
    rows = t.expert_rows(tokens, layout.expert, layout.batch_slices * layout.context)
    units = 3 if t.gated_mlp else 2  # kept per hidden unit: its input(s) to the activation, it
    hidden = units * t.expert_width / layout.tensor  # split over tensor as Megatron splits an MLP
    elements = rows * (t.width + hidden)
    shared = units * moe.shared_expert_dim / layout.tensor
    elements += tokens * (moe.experts_per_token * t.width + shared)
    router = 2 * tokens * moe.num_experts * 4
    dense = 16 * tokens * t.width / 2 / layout.tensor
    return (elements - dense) * workload.compute_bytes + router


def _per_layer(sbh: float, replicated: float, split: float, scores: float, layout) -> float:
    """s b h (replicated + split / t + scores / t) 16-bit bytes of one layer: `replicated` the
    terms tensor parallelism leaves whole (unless with sequence parallelism), `split` those it
    splits, `scores` the attention's (already times a s / h)."""
    t = layout.tensor
    if layout.sequence_parallel:
        return sbh * (replicated + split + scores) / t
    return sbh * (replicated + split / t + scores / t)


def context_kv_bytes(workload: Workload, layout: Layout, rows: int) -> tuple[float, float]:
    """(keys and values one layer keeps for the backward, the ring's message in flight) under
    context parallelism, float32, split over tensor by heads: all_gather keeps the whole
    sequence's per layer; the ring none, and one message of keys, values and their gradients
    travels at a time. (0, 0) without a context axis."""
    t = workload.transformer
    if layout.context == 1:
        return 0.0, 0.0
    kv_width = (t.kv_heads or t.heads) * t.head_dim / layout.tensor
    block = rows * t.seq_len / layout.context * kv_width * 4
    if layout.context_attention == "all_gather":
        return 2 * block * layout.context, 0.0
    return 0.0, 4 * block


def gathered_bytes(workload: Workload, layout: Layout) -> int:
    """zero3's gathered parameters (one tensor rank's part, its own experts): jddp gathers the
    whole model at the start of the step and keeps it for the backward pass; a run that gathers
    layer by layer (`workload.gathers_whole_model=False`) holds two layers' worth. Under `auto` the
    parameters XLA gathers (jddp/planner/auto.py), assumed held as long."""
    if layout.strategy not in SPLIT_PARAMS or layout.fsdp == 1:
        return 0
    shards, sizes = param_shards(workload, layout), layout.sizes
    if layout.strategy == "auto":
        picked = {c.path for c in auto.choices(workload, layout) if c.choice == auto.GATHER}
        shards = [p for p in shards if p.path in picked]
    gathered = sum(p.nbytes // p.split(sizes, RULE_AXES) for p in shards)
    if workload.gathers_whole_model or workload.transformer is None:
        return gathered
    return gathered * 2 // max(1, workload.transformer.layers // layout.stage)
