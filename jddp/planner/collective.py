"""A collective as the planner counts it: its kind, the mesh axes it runs over, the bytes of its
result per device, how many run per step, and the phase of the step it runs in (which decides
what compute can hide it). What jddp/planner/comm.py (the strategies' and tensor parallelism's
collectives) and jddp/planner/stages.py (the stage axis's) both build.
"""

import dataclasses

# When a collective runs, which decides what compute it can hide under (jddp/planner/timing.py).
FORWARD = "forward"  # zero3's parameter all-gathers: the next layer's, during this one
BACKWARD = "backward"  # gradient reductions: a layer's, during the next layer's backward
CRITICAL = "critical"  # activations between a layer's matmuls: nothing to hide under
UPDATE = "update"  # after the optimizer update (zero1/2 gather the updated parameters)


@dataclasses.dataclass(frozen=True)
class Collective:
    """`count` ops of one kind over mesh `axes`, each with a result of `nbytes` per device."""

    kind: str  # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    axes: tuple[str, ...]
    nbytes: float
    count: float
    phase: str
    what: str

    @property
    def total(self) -> float:
        return self.nbytes * self.count


def merged(collectives) -> list[Collective]:
    """`collectives` with those of equal kind, axes, size and phase merged (counts added):
    one per layer becomes one per model."""
    counts: dict[tuple, float] = {}
    for c in collectives:
        key = (c.kind, c.axes, c.nbytes, c.phase, c.what)
        counts[key] = counts.get(key, 0) + c.count
    return [Collective(k, a, n, count, p, w) for (k, a, n, p, w), count in counts.items()]


def bytes_by_axes(collectives) -> dict[tuple[tuple[str, ...], str], float]:
    """{(axes, kind): bytes} over `collectives`, keyed as jddp.observe.hlo.bytes_by_axes keys
    them."""
    totals: dict[tuple[tuple[str, ...], str], float] = {}
    for c in collectives:
        totals[(c.axes, c.kind)] = totals.get((c.axes, c.kind), 0) + c.total
    return totals
