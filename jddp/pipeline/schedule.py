"""Pipeline schedules as timetables: which stage runs which micro-batch's forward or backward at
every tick, and which buffer slot each activation waits in.

A tick is one unit of work on every stage at once (all stages step together in one SPMD
program); forward and backward each take one tick. A stage's output reaches its neighbour at
the next tick. From the same dependencies, two policies:

    gpipe  all forwards first, then all backwards (Huang et al., 2019): every stage holds the
           activations of all M micro-batches before the first backward
    1f1b   after a warm-up, one forward then one backward (PipeDream-Flush, Narayanan et al.,
           2021): stage s holds at most S - s micro-batches' activations

Both take 2 (M + S - 1) ticks, so the idle fraction (the bubble) is (S - 1) / (M + S - 1).
"""

import dataclasses

import numpy as np

from jddp.errors import ConfigError

IDLE, FORWARD, BACKWARD = 0, 1, 2
SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A timetable; every table is (ticks, stages), -1 where nothing happens.

    `op`, `microbatch`: what each stage does. `stash`: the slot a forward keeps its activations
    for the backward in (read back by that backward). `read`: the inbox slot a forward reads its
    input from (stages after the first) and a backward its cotangent from. `arrive_forward`,
    `arrive_backward`: the inbox slot where what the previous (next) stage sent at this tick is
    put; the last stage's own output cotangent is put at `arrive_backward` of its forward tick.
    """

    name: str
    stages: int
    microbatches: int
    op: np.ndarray
    microbatch: np.ndarray
    stash: np.ndarray
    read: np.ndarray
    arrive_forward: np.ndarray
    arrive_backward: np.ndarray
    stash_slots: int
    forward_slots: int
    backward_slots: int

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    @property
    def bubble(self) -> float:
        """The idle fraction of the stages' ticks."""
        return float(np.mean(self.op == IDLE))


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


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The timetable of schedule `name` for `stages` stages and `microbatches` micro-batches."""
    if name not in SCHEDULES:
        raise ConfigError(
            f"unknown parallel.pipeline.schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
        )
    S, M = stages, microbatches
    ticks = 2 * (M + S - 1)
    tables = {k: np.full((ticks, S), -1, np.int32) for k in ("mb", "stash", "read", "af", "ab")}
    op = np.full((ticks, S), IDLE, np.int32)
    next_forward, next_backward = [0] * S, [0] * S
    inbox_forward = [dict() for _ in range(S)]  # micro-batch -> slot, arrived and not yet used
    inbox_backward = [dict() for _ in range(S)]
    stashed = [dict() for _ in range(S)]
    slots = {k: [_Slots() for _ in range(S)] for k in ("stash", "forward", "backward")}
    for t in range(ticks):
        arrivals = []  # (kind, stage, micro-batch), delivered at the end of this tick
        for s in range(S):
            m_f, m_b = next_forward[s], next_backward[s]
            can_forward = m_f < M and (s == 0 or m_f in inbox_forward[s])
            can_backward = m_b < m_f and m_b in inbox_backward[s]
            if name == "1f1b":
                can_forward = can_forward and m_f - m_b < S - s
                choice = BACKWARD if can_backward else FORWARD if can_forward else IDLE
            else:
                choice = FORWARD if can_forward else BACKWARD if can_backward else IDLE
            op[t, s] = choice
            if choice == FORWARD:
                tables["mb"][t, s] = m_f
                if s > 0:
                    slot = inbox_forward[s].pop(m_f)
                    tables["read"][t, s] = slot
                    slots["forward"][s].give(slot)
                stashed[s][m_f] = tables["stash"][t, s] = slots["stash"][s].take()
                arrivals.append(("forward", s + 1, m_f) if s < S - 1 else ("backward", s, m_f))
                next_forward[s] += 1
            elif choice == BACKWARD:
                tables["mb"][t, s] = m_b
                slot = inbox_backward[s].pop(m_b)
                tables["read"][t, s] = slot
                slots["backward"][s].give(slot)
                tables["stash"][t, s] = stashed[s].pop(m_b)
                slots["stash"][s].give(tables["stash"][t, s])
                if s > 0:
                    arrivals.append(("backward", s - 1, m_b))
                next_backward[s] += 1
        for kind, s, m in arrivals:
            slot = slots[kind][s].take()
            (inbox_forward if kind == "forward" else inbox_backward)[s][m] = slot
            # The last stage's own cotangent is stored by its forward, at that tick.
            tables["af" if kind == "forward" else "ab"][t, s] = slot
    if any(n < M for n in next_backward):
        raise AssertionError(f"schedule {name} did not finish in {ticks} ticks")
    return Schedule(
        name=name,
        stages=S,
        microbatches=M,
        op=op,
        microbatch=np.maximum(tables["mb"], 0),
        stash=np.maximum(tables["stash"], 0),
        read=np.maximum(tables["read"], 0),
        arrive_forward=tables["af"],
        arrive_backward=tables["ab"],
        stash_slots=max(x.size for x in slots["stash"]),
        forward_slots=max(1, max(x.size for x in slots["forward"])),
        backward_slots=max(x.size for x in slots["backward"]),
    )
