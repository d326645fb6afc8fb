"""The `stage` axis (pipeline parallelism) in the planner, as jddp's pipeline engine runs it
(jddp/parallel/pipeline/: a lockstep SPMD program over a timetable of ticks), or, for a published
run (`Workload.lockstep_pipeline=False`), as Megatron-LM runs it (each stage at its own pace).

- Each of S stages holds L/S transformer blocks; the parameters outside the stack (embedding,
  positions, final norm, head) are on every stage (jddp) or on the first and last (Megatron):
  the first stage, the most loaded, is planned for.
- A step runs M micro-batches per accumulation step through the pipeline. The idle share of a
  stage's time, the bubble, is jddp/parallel/pipeline/schedule.py `bubble_fraction`:
  (S - 1) / (v M + S - 1), v the model chunks per device (`parallel.pipeline.repeats`;
  Megatron's interleaved schedule). GPipe and 1F1B have the same bubble.
- Neighbouring stages exchange activations forward and cotangents back (collective-permutes of
  one micro-batch's B_micro x T x width, split over tensor with sequence parallelism, as
  Megatron-LM scatters and gathers it). jddp's engine sends both ways at every tick of the
  timetable (sends of idle stages carry filler: the bytes still move), and after the ticks
  all-reduces the gradients of the parameters outside the stack over the stages (float32).
  Megatron sends only real work: 2 v M sends per step. With v > 1 jddp's timetable has v times
  the ticks of real work, each sending both ways (the v-fold point-to-point traffic); each
  stage holds the layer groups it runs (groups s, s + S, ...), so no layer crosses the stages.

Validated against the compiled pipeline: tests/test_planner_comm.py (bytes per axis, exact) and
experiments/bench/planner.py (step time on this machine).
"""

import functools

from jddp.parallel.pipeline.schedule import bubble_fraction as schedule_bubble
from jddp.parallel.pipeline.schedule import make_schedule
from jddp.planner.collective import CRITICAL, UPDATE, Collective
from jddp.planner.layouts import Layout
from jddp.planner.shards import param_shards
from jddp.planner.workload import Workload

MICROBATCHES_PER_STAGE = 4  # automatic M: 4 S when the batch allows (M >= 4S keeps the bubble
# under ~20%, Narayanan et al. 2021)


def microbatches(workload: Workload, layout: Layout) -> int:
    """M: the workload's (`parallel.pipeline.microbatches`), or the largest divisor of a
    replica's rows per accumulation step up to 4 S."""
    if layout.stage == 1:
        return 1
    if workload.microbatches:
        return workload.microbatches
    rows = workload.global_batch // (layout.batch_slices * workload.grad_accum_steps)
    limit = MICROBATCHES_PER_STAGE * layout.stage
    return max(m for m in range(1, min(rows, limit) + 1) if rows % m == 0)


def bubble_fraction(workload: Workload, layout: Layout) -> float:
    """The share of a pipelined step that a device idles (0 without stages)."""
    if layout.stage == 1:
        return 0.0
    m = microbatches(workload, layout) * workload.grad_accum_steps
    return schedule_bubble(layout.stage, m, workload.virtual_stages)


@functools.lru_cache(maxsize=256)
def ticks(schedule: str, stages: int, micro: int, layers_per_chunk: int, repeats: int = 1) -> int:
    """Ticks of jddp's timetable (the backward in two ticks with 2 layers per group or more)."""
    return make_schedule(schedule, stages, micro, layers_per_chunk >= 2, repeats).ticks


def stage_collectives(workload: Workload, layout: Layout):
    """The stage axis's collectives in one step (none without stages)."""
    t = workload.transformer
    if layout.stage == 1 or t is None:
        return []
    m = microbatches(workload, layout)
    accum = workload.grad_accum_steps
    rows = workload.global_batch // (layout.batch_slices * m * accum)
    activation = rows * t.seq_len * t.width * workload.compute_bytes
    if not workload.lockstep_pipeline:  # Megatron: forward and backward per chunk boundary
        sends = 2 * workload.virtual_stages * m * accum
        nbytes = activation / layout.tensor
        return [Collective("collective-permute", ("stage",), nbytes, sends, CRITICAL, "stages")]
    if layout.sequence_parallel:
        activation /= layout.tensor
    v = workload.virtual_stages
    per_chunk = t.layers // (layout.stage * v)
    sends = 2 * ticks(workload.pipeline_schedule, layout.stage, m, per_chunk, v)
    out = [
        Collective("collective-permute", ("stage",), activation, sends * accum, CRITICAL, "stages")
    ]
    # The replicated (trainable) parameters' float32 gradients, summed over the stages once
    # per pipeline.
    replicated = 0
    for p in param_shards(workload, layout):
        if p.block is None and p.trains:
            tensor_split = p.split_over("tensor") or (
                layout.sequence_parallel and p.path == "position_embed"
            )
            replicated += 4 * p.elements // (layout.tensor if tensor_split else 1)
    if replicated:
        out.append(Collective("all-reduce", ("stage",), replicated, accum, UPDATE, "stage grads"))
    return out


def check_stages(workload: Workload, layout: Layout) -> str | None:
    """Why the workload cannot be split into `layout`'s stages (None if it can)."""
    t = workload.transformer
    stages = layout.stage
    if stages == 1:
        return None
    if t is None:
        return "only transformers are planned with a stage axis"
    if t.layers % (stages * workload.virtual_stages):
        return f"{t.layers} layers do not split into {stages} stages"
    rows = workload.global_batch // (layout.batch_slices * workload.grad_accum_steps)
    m = microbatches(workload, layout)
    if rows % m:
        return f"{rows} rows per replica do not split into {m} micro-batches"
    if workload.lockstep_pipeline and m < stages:
        return f"{m} micro-batches are fewer than the {stages} stages"
    return None
