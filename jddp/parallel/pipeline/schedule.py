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
MaxText's maintainers hold 1F1B to need MPMD, devices at their own pace; the split backward is
what lets one lockstep program reach 1F1B's memory with GPipe's bubble.
"""

import dataclasses

import numpy as np

from jddp.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b")
IDLE, FORWARD, BACKWARD_HIGH, BACKWARD_LOW = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A timetable; every table is (ticks, stages).

    `op`: what each stage runs (IDLE, FORWARD, BACKWARD_HIGH, BACKWARD_LOW), on micro-batch
    `microbatch`. A forward keeps its activations in stash slot `stash`, where the two
    backward halves read them. `read`: the forward-inbox slot a forward takes its input from
    (stages after the first), the backward-inbox slot BACKWARD_HIGH takes its cotangent from,
    the middle slot BACKWARD_LOW takes the first half's cotangent from (written by
    BACKWARD_HIGH at `middle`). What a neighbour sent in a tick goes into inbox slot
    `arrive_forward` / `arrive_backward` at its end (-1: nothing arrives); the last stage's own
    output cotangent, from its forward, arrives at its `arrive_backward` slot.
    """

    name: str
    stages: int
    microbatches: int
    split_backward: bool
    op: np.ndarray
    microbatch: np.ndarray
    stash: np.ndarray
    read: np.ndarray
    middle: np.ndarray
    arrive_forward: np.ndarray
    arrive_backward: np.ndarray
    stash_slots: int
    forward_slots: int
    backward_slots: int
    middle_slots: int

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    def bubble(self, layers_per_stage: int = 2) -> float:
        """The idle fraction of every stage's time, a forward costing one unit per layer and a
        backward two, each tick as long as its slowest stage."""
        low = layers_per_stage // 2 if self.split_backward else 0
        cost = np.array([0, layers_per_stage, 2 * (layers_per_stage - low), 2 * low])
        busy = self.microbatches * 3 * layers_per_stage
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


def make_schedule(name: str, stages: int, microbatches: int, split_backward: bool) -> Schedule:
    """The timetable of schedule `name` for `stages` stages and `microbatches` micro-batches,
    with the backward in two ticks (`split_backward`) or one."""
    if name not in SCHEDULES:
        raise ConfigError(
            f"unknown parallel.pipeline.schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
        )
    S, M = stages, microbatches
    forwarded, high_done, backwarded = [0] * S, [0] * S, [0] * S
    inbox_f, inbox_b, stashed, middle = ([{} for _ in range(S)] for _ in range(4))
    slots = {k: [_Slots() for _ in range(S)] for k in ("stash", "forward", "backward", "middle")}
    names = ("op", "microbatch", "stash", "read", "middle", "arrive_forward", "arrive_backward")
    rows = {k: [] for k in names}
    while min(backwarded) < M:
        row = {k: [IDLE if k == "op" else -1] * S for k in names}
        arrive_f, arrive_b = [], []  # (stage, micro-batch), delivered at the end of the tick

        def backward_done(s, m, row=row, arrive_b=arrive_b):
            backwarded[s] += 1
            row["stash"][s] = stashed[s].pop(m)
            slots["stash"][s].give(row["stash"][s])
            if s > 0:
                arrive_b.append((s - 1, m))

        for s in range(S):
            m_low, m_high, m_fwd = backwarded[s], high_done[s], forwarded[s]
            may_backward = name == "1f1b" or m_fwd == M
            if split_backward and m_low < m_high:  # the second backward tick, always next
                row["op"][s], row["microbatch"][s] = BACKWARD_LOW, m_low
                row["read"][s] = middle[s].pop(m_low)
                slots["middle"][s].give(row["read"][s])
                backward_done(s, m_low)
            elif m_high < m_fwd and m_high in inbox_b[s] and may_backward:
                row["op"][s], row["microbatch"][s] = BACKWARD_HIGH, m_high
                row["read"][s] = inbox_b[s].pop(m_high)
                slots["backward"][s].give(row["read"][s])
                high_done[s] += 1
                if split_backward:
                    middle[s][m_high] = row["middle"][s] = slots["middle"][s].take()
                    row["stash"][s] = stashed[s][m_high]
                else:
                    backward_done(s, m_high)
            elif (
                m_fwd < M
                and (s == 0 or m_fwd in inbox_f[s])
                and m_fwd - m_low < (S - s if name == "1f1b" else M)
            ):
                row["op"][s], row["microbatch"][s] = FORWARD, m_fwd
                if s > 0:
                    row["read"][s] = inbox_f[s].pop(m_fwd)
                    slots["forward"][s].give(row["read"][s])
                stashed[s][m_fwd] = row["stash"][s] = slots["stash"][s].take()
                arrive_b.append((s, m_fwd)) if s == S - 1 else arrive_f.append((s + 1, m_fwd))
                forwarded[s] += 1
        for s, m in arrive_f:
            inbox_f[s][m] = row["arrive_forward"][s] = slots["forward"][s].take()
        for s, m in arrive_b:
            inbox_b[s][m] = row["arrive_backward"][s] = slots["backward"][s].take()
        for k in names:
            rows[k].append(row[k])
        if len(rows["op"]) > 6 * (M + S):
            raise AssertionError(f"schedule {name} does not finish")
    table = {k: np.asarray(v, np.int32) for k, v in rows.items()}
    for k in ("microbatch", "stash", "read", "middle"):  # gathers index with these: never -1
        table[k] = np.maximum(table[k], 0)
    return Schedule(
        name=name,
        stages=S,
        microbatches=M,
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
