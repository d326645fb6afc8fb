"""Pipeline schedules as timetables: at every tick, what each stage runs, and which buffer slot
each activation and cotangent waits in.

All stages step together (one SPMD program), so a tick lasts as long as its slowest stage. For
no stage to wait on another, every tick's work should cost the same: a backward costs about
twice a forward, so it is split into two ticks, the backward of the stage's second half of
layers (`BACKWARD_HIGH`) then of its first half (`BACKWARD_LOW`); a stage of one layer runs its
whole backward in one tick (`BACKWARD_HIGH`). What a stage sends reaches its neighbour at the
next tick (the last stage's own output cotangent too). From the same dependencies, two
policies:

    gpipe  all forwards first, then all backwards (Huang et al., 2019): every stage holds the
           activations of all M micro-batches before the first backward
    1f1b   after a warm-up, forwards and backwards alternate (PipeDream-Flush, Narayanan et al.,
           2021): stage s holds at most S - s micro-batches' activations

Both take (M + S - 1) x (forward + backward) time, so the idle fraction (the bubble) is
(S - 1) / (M + S - 1): `bubble_fraction`, checked against every timetable's `Schedule.bubble`.

Interleaved (`repeats` V > 1): the layers are cut into V S groups, stage s runs groups s, s + S,
..., its chunks 0 to V - 1, and a micro-batch circles the stages V times (the last stage sends
chunk r's output to the first stage's chunk r + 1). Each stage takes its micro-batches in groups
of S through every chunk (Megatron-LM's virtual pipeline, which needs M a multiple of S): GPipe's
circular form (MaxText's `num_pipeline_repeats`) runs every forward first, 1F1B warms up with
(V - 1) S + 2 (S - s - 1) forwards. A chunk's work is 1/V of a stage's, the fill and drain the
same S - 1 ticks of it: the bubble shrinks to (S - 1) / (V M + S - 1).
MaxText's maintainers hold 1F1B to need MPMD, devices at their own pace; the split backward is
what lets one lockstep program reach 1F1B's memory with GPipe's bubble.
"""

import dataclasses

import numpy as np

from jddp.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b")
IDLE, FORWARD, BACKWARD_HIGH, BACKWARD_LOW = 0, 1, 2, 3
# The timetable's tables, each (ticks, stages): see `Schedule`.
TABLES = (
    "op",
    "microbatch",
    "chunk",
    "stash",
    "read",
    "middle",
    "arrive_forward",
    "arrive_backward",
    "arrive_own",
)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A timetable; every table is (ticks, stages).

    `op`: what each stage runs (IDLE, FORWARD, BACKWARD_HIGH, BACKWARD_LOW), on micro-batch
    `microbatch` through the stage's layer group `chunk` (0 to repeats - 1). A forward keeps its
    activations in stash slot `stash`, where the two backward halves read them. `read`: the
    forward-inbox slot a forward takes its input from (all but the first stage's chunk 0), the
    backward-inbox slot BACKWARD_HIGH takes its cotangent from, the middle slot BACKWARD_LOW
    takes the first half's cotangent from (written by BACKWARD_HIGH at `middle`). What a
    neighbour sent in a tick goes into inbox slot `arrive_forward` / `arrive_backward` at its
    end (-1: nothing arrives); the last stage's own output cotangent, from its forward, arrives
    at its `arrive_own` slot.
    """

    name: str
    stages: int
    microbatches: int
    repeats: int
    split_backward: bool
    op: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    stash: np.ndarray
    read: np.ndarray
    middle: np.ndarray
    arrive_forward: np.ndarray
    arrive_backward: np.ndarray
    arrive_own: np.ndarray
    stash_slots: int
    forward_slots: int
    backward_slots: int
    middle_slots: int

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    def bubble(self, layers_per_chunk: int = 2) -> float:
        """The idle fraction of every stage's time, a forward costing one unit per layer and a
        backward two, each tick as long as its slowest stage."""
        low = layers_per_chunk // 2 if self.split_backward else 0
        cost = np.array([0, layers_per_chunk, 2 * (layers_per_chunk - low), 2 * low])
        busy = self.repeats * self.microbatches * 3 * layers_per_chunk
        return 1.0 - busy / float(np.sum(cost[self.op].max(axis=1)))


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """(S - 1) / (v M + S - 1): the idle fraction of a synchronous pipeline schedule."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


class _Slots:
    """Buffer slots handed out and returned; `size` is the most ever in use."""

    def __init__(self):
        self.free, self.size = [], 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)


def group_order(stages: int, microbatches: int, chunks) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in the order a stage runs them: micro-batches in groups of S, each
    group through every chunk of `chunks` before the next group (Megatron-LM's interleaved
    order; with one chunk, micro-batch order)."""
    return [
        (r, m)
        for first in range(0, microbatches, stages)
        for r in chunks
        for m in range(first, min(first + stages, microbatches))
    ]


def _sequence(name: str, S: int, M: int, V: int, s: int) -> list[tuple[int, tuple[int, int]]]:
    """Stage `s`'s ops in order, as (FORWARD or BACKWARD_HIGH, (chunk, micro-batch)): GPipe's
    every forward, then every backward; 1F1B's warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards. The warm-up is PipeDream's S - s - 1 with
    one chunk, Megatron-LM's (V - 1) S + 2 (S - s - 1) with V: for the first backward to
    reach the stage by the time it runs out of forwards."""
    forwards = [(FORWARD, job) for job in group_order(S, M, range(V))]
    backwards = [(BACKWARD_HIGH, job) for job in group_order(S, M, range(V - 1, -1, -1))]
    if name == "gpipe":
        return forwards + backwards
    warm_up = min(V * M, S - s - 1 if V == 1 else (V - 1) * S + 2 * (S - s - 1))
    steady = [op for pair in zip(forwards[warm_up:], backwards, strict=False) for op in pair]
    return forwards[:warm_up] + steady + backwards[V * M - warm_up :]


def make_schedule(
    name: str, stages: int, microbatches: int, split_backward: bool, repeats: int = 1
) -> Schedule:
    """The timetable of schedule `name` for `stages` stages, `microbatches` micro-batches and
    `repeats` chunks (layer groups) per stage, with the backward in two ticks
    (`split_backward`) or one."""
    if name not in SCHEDULES:
        raise ConfigError(
            f"unknown parallel.pipeline.schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
        )
    S, M, V = stages, microbatches, repeats
    sequences = [_sequence(name, S, M, V, s) for s in range(S)]
    done = [0] * S  # how far each stage is in its sequence
    low_next = [None] * S  # the job whose second backward tick comes next (split backward)
    inbox_f, inbox_b, stashed, middle = ([{} for _ in range(S)] for _ in range(4))
    slots = {k: [_Slots() for _ in range(S)] for k in ("stash", "forward", "backward", "middle")}
    names = TABLES
    rows = {k: [] for k in names}
    while any(done[s] < len(sequences[s]) or low_next[s] for s in range(S)):
        row = {k: [IDLE if k == "op" else -1] * S for k in names}
        # (stage, (chunk, micro-batch)), delivered at the tick's end; the last stage's own output
        # cotangent apart: with chunks, the first stage may send it one in the same tick.
        arrive_f, arrive_b, arrive_own = [], [], []

        def backward_done(s, job, row=row, arrive_b=arrive_b):
            row["stash"][s] = stashed[s].pop(job)
            slots["stash"][s].give(row["stash"][s])
            r, m = job
            if s > 0:
                arrive_b.append((s - 1, job))
            elif r > 0:  # the previous chunk is on the last stage
                arrive_b.append((S - 1, (r - 1, m)))

        for s in range(S):
            op, job = sequences[s][done[s]] if done[s] < len(sequences[s]) else (IDLE, None)
            if low_next[s]:  # the second backward tick, always next
                job, low_next[s] = low_next[s], None
                row["op"][s], (row["chunk"][s], row["microbatch"][s]) = BACKWARD_LOW, job
                row["read"][s] = middle[s].pop(job)
                slots["middle"][s].give(row["read"][s])
                backward_done(s, job)
            elif op == BACKWARD_HIGH and job in inbox_b[s]:
                done[s] += 1
                row["op"][s], (row["chunk"][s], row["microbatch"][s]) = BACKWARD_HIGH, job
                row["read"][s] = inbox_b[s].pop(job)
                slots["backward"][s].give(row["read"][s])
                if split_backward:
                    low_next[s] = job
                    middle[s][job] = row["middle"][s] = slots["middle"][s].take()
                    row["stash"][s] = stashed[s][job]
                else:
                    backward_done(s, job)
            elif op == FORWARD and (job in inbox_f[s] or (s, job[0]) == (0, 0)):
                done[s] += 1
                r, m = job
                row["op"][s], (row["chunk"][s], row["microbatch"][s]) = FORWARD, job
                if s > 0 or r > 0:
                    row["read"][s] = inbox_f[s].pop(job)
                    slots["forward"][s].give(row["read"][s])
                stashed[s][job] = row["stash"][s] = slots["stash"][s].take()
                if s < S - 1:
                    arrive_f.append((s + 1, job))
                elif r < V - 1:  # on to the next chunk, on the first stage
                    arrive_f.append((0, (r + 1, m)))
                else:
                    arrive_own.append((s, job))
        for s, job in arrive_f:
            inbox_f[s][job] = row["arrive_forward"][s] = slots["forward"][s].take()
        for s, job in arrive_b:
            inbox_b[s][job] = row["arrive_backward"][s] = slots["backward"][s].take()
        for s, job in arrive_own:
            inbox_b[s][job] = row["arrive_own"][s] = slots["backward"][s].take()
        for k in names:
            rows[k].append(row[k])
        if len(rows["op"]) > 6 * (V * M + S):
            raise AssertionError(f"schedule {name} does not finish")
    table = {k: np.asarray(v, np.int32) for k, v in rows.items()}
    for k in ("microbatch", "chunk", "stash", "read", "middle"):  # gathers index: never -1
        table[k] = np.maximum(table[k], 0)
    return Schedule(
        name=name,
        stages=S,
        microbatches=M,
        repeats=V,
        split_backward=split_backward,
        **table,
        stash_slots=max(x.size for x in slots["stash"]),
        forward_slots=max(1, max(x.size for x in slots["forward"])),
        backward_slots=max(x.size for x in slots["backward"]),
        middle_slots=max(1, max(x.size for x in slots["middle"])),
    )


def timeline(schedule: Schedule) -> str:
    """The timetable as text, one line per stage and one column per tick: the micro-batch
    number where a stage runs a forward, `b` / `B` for the backward's two halves (`B` alone when
    it is one tick), `.` where the stage idles."""
    lines = []
    for s in range(schedule.stages):
        cells = []
        for op, m in zip(schedule.op[:, s], schedule.microbatch[:, s], strict=True):
            mark = {IDLE: ".", FORWARD: str(m % 10), BACKWARD_HIGH: "B", BACKWARD_LOW: "b"}[op]
            cells.append(mark)
        lines.append(f"stage {s}  " + "".join(cells))
    return "\n".join(lines)
