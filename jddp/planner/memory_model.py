"""Bytes one device holds: the training state exactly (shapes and partition rules, as
jddp/observe/memory.py `sharded_bytes` counts them), activations analytically for transformers.

Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4; 16-bit activations, b rows of s tokens, width h, a heads,
tensor size t): s b h (34 + 5 a s / h) bytes without tensor parallelism, s b h (10 + 24/t +
5 a s / (h t)) with it, s b h (34 + 5 a s / h) / t with sequence parallelism; 2 s b h with
every layer recomputed (only the layer's input is kept) plus one layer's worth while it is
recomputed, once (any recomputation is planned this way: only layer inputs are kept). Scaled by
bytes per activation / 2; the float32 logits (and their gradient) added.
"""

import dataclasses
import functools

from jddp.planner import auto
from jddp.planner.layouts import SPLIT_PARAMS, Layout
from jddp.planner.shards import all_shards, on_first_stage, optimizer_table, param_shards
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
    (most loaded) pipeline stage, as jddp/planner/shards.py lays each out."""
    key = Layout(layout.strategy, fsdp=layout.fsdp, tensor=layout.tensor, stage=layout.stage)
    return _state_bytes(workload, key)


@functools.lru_cache(maxsize=4096)
def _state_bytes(workload: Workload, layout: Layout) -> StateBytes:
    shards = all_shards(workload, layout)
    sizes = layout.sizes
    params = grads = 0
    for p in shards:
        if on_first_stage(p, workload, layout.stage):
            whole_over_fsdp = p.nbytes // p.split(sizes, ("tensor",))
            split_params = layout.strategy in SPLIT_PARAMS
            params += p.nbytes // p.split(sizes) if split_params else whole_over_fsdp
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
    rows = workload.global_batch // (layout.batch_shards * m)
    sbh = t.seq_len * rows * t.width
    heads_term = 0 if t.fused_attention else 5 * t.heads * t.seq_len / t.width
    tensor = layout.tensor
    if tensor == 1:
        per_layer = sbh * (34 + heads_term)
    elif layout.sequence_parallel:
        per_layer = sbh * (34 + heads_term) / tensor
    else:
        per_layer = sbh * (10 + 24 / tensor + heads_term / tensor)
    per_layer *= workload.compute_bytes / 2
    layers = t.layers // layout.stage
    in_flight = min(m, layout.stage)  # 1F1B: the first stage holds S micro-batches
    if workload.recompute:  # only each layer's input is kept (split over tensor with SP);
        # one layer's activations exist while it is recomputed, for one micro-batch at a time
        kept_input = sbh * workload.compute_bytes / (tensor if layout.sequence_parallel else 1)
        kept = layers * kept_input * in_flight + per_layer
    else:
        kept = layers * per_layer * in_flight
    logits = 2 * rows * t.seq_len * t.vocab / tensor * 4
    return int(kept + logits)


def gathered_bytes(workload: Workload, layout: Layout) -> int:
    """zero3's gathered parameters (one tensor rank's part): jddp gathers the whole model at
    the start of the step and keeps it for the backward pass; a run that gathers layer by
    layer (`workload.gathers_whole_model=False`) holds two layers' worth. Under `auto` the
    parameters XLA gathers (jddp/planner/auto.py), assumed held as long."""
    if layout.strategy not in SPLIT_PARAMS or layout.fsdp == 1:
        return 0
    shards, sizes = param_shards(workload, layout), layout.sizes
    if layout.strategy == "auto":
        picked = {c.path for c in auto.choices(workload, layout) if c.choice == auto.GATHER}
        shards = [p for p in shards if p.path in picked]
    gathered = sum(p.nbytes // p.split(sizes, ("tensor",)) for p in shards)
    if workload.gathers_whole_model or workload.transformer is None:
        return gathered
    return gathered * 2 // max(1, workload.transformer.layers // layout.stage)
