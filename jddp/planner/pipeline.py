"""The `stage` axis (pipeline parallelism), analytically. ANALYTIC ONLY: jddp's pipeline is
being built (issue 11) and nothing here has been checked against a measured or compiled
pipeline yet; everything the planner says about stage > 1 comes from this file alone, so it
can be validated, or replaced, in one place.

- Each of S stages holds L/S transformer blocks (the first also the embedding: the most loaded
  stage is planned for), so parameters, gradients and optimizer state per device shrink ~1/S.
- A step runs M micro-batches through the pipeline (GPipe or 1F1B: the same bubble). With v
  model chunks per device (the interleaved schedule, Narayanan et al. 2021) the idle share of
  the step is the bubble (S - 1) / (v M + S - 1), as MaxText's pipeline computes it.
- Neighbouring stages exchange one micro-batch's activations forward and their gradient
  backward: a collective-permute of B_micro x T x width per micro-batch, chunk and direction
  (split over tensor when there is a tensor axis, as Megatron-LM scatters and gathers it).
"""

from jddp.planner.layouts import Layout
from jddp.planner.workload import Workload

MICROBATCHES_PER_STAGE = 4  # automatic M: 4 S when the batch allows (M >= 4S keeps the bubble
# under ~20%, Narayanan et al. 2021)


def microbatches(workload: Workload, layout: Layout) -> int:
    """M: the workload's, or the largest divisor of a replica's rows up to 4 S."""
    if layout.stage == 1:
        return 1
    if workload.microbatches:
        return workload.microbatches
    rows = workload.global_batch // (layout.batch_shards * workload.grad_accum_steps)
    limit = MICROBATCHES_PER_STAGE * layout.stage
    return max(m for m in range(1, min(rows, limit) + 1) if rows % m == 0)


def bubble_fraction(workload: Workload, layout: Layout) -> float:
    """The share of a pipelined step that a device idles: (S - 1) / (v M + S - 1)."""
    stages = layout.stage
    if stages == 1:
        return 0.0
    m = microbatches(workload, layout) * workload.grad_accum_steps
    return (stages - 1) / (workload.virtual_stages * m + stages - 1)


def stage_collectives(workload: Workload, layout: Layout):
    """The activation sends between neighbouring stages in one step (none without stages)."""
    from jddp.planner.comm import CRITICAL, Collective

    t = workload.transformer
    if layout.stage == 1 or t is None:
        return []
    m = microbatches(workload, layout) * workload.grad_accum_steps
    rows = workload.global_batch // (layout.batch_shards * m)
    activation = rows * t.seq_len * t.width * workload.compute_bytes / layout.tensor
    count = 2 * workload.virtual_stages * m  # forward and backward, per chunk boundary
    return [Collective("collective-permute", ("stage",), activation, count, CRITICAL, "stages")]


def check_stages(workload: Workload, stages: int) -> str | None:
    """Why `stages` cannot split the workload (None if it can)."""
    t = workload.transformer
    if stages == 1:
        return None
    if t is None:
        return "only transformers are planned with a stage axis"
    if t.layers % (stages * workload.virtual_stages):
        return f"{t.layers} layers do not split into {stages} stages"
    return None
