"""Goodput: where the wall time of a run in one workdir went, over all its starts.

A `Ledger` is a stopwatch that always runs in exactly one category and is switched between them,
so the categories of one start add up to that start's wall time by construction. It persists in
`WORKDIR/goodput.json` (process 0 only, atomically), and a start that resumes a checkpoint moves
the productive time of the steps after it, done by earlier starts and about to be redone, from
their `steps` to `lost`; the gap since the previous start's last update is `restart`.

    summary = jddp.observe.goodput.read("runs/a")   # {"fraction": 0.87, "seconds": {...}, ...}
"""

import contextlib
import json
import math
import os
import time
from collections.abc import Callable

from absl import logging

from jddp.errors import UsageError, WorkdirError
from jddp.runtime import atomic_write

FILE = "goodput.json"
VERSION = 1
CATEGORIES = (
    "startup",  # process start (or fit's start) until the loop begins, restore excluded
    "restore",  # checkpoint restores
    "compile",  # the first step of each start, compilation included
    "steps",  # productive training steps (those never redone)
    "data",  # waiting for the next batch
    "eval",  # evaluation
    "save",  # checkpoint saves on the main thread, and the final wait for an async save
    "other",  # logging, hooks, the loop's own work
    "lost",  # steps done and then redone after a restart or rollback (moved out of `steps`)
    "restart",  # from the previous start's last update to this start's process start
)
PRODUCTIVE = "steps"
SUMMARY_KEYS = ("fraction", "wall_sec", "seconds", "lost_steps", "starts", "restarts", "step")
FLUSH_EVERY_S = 1.0  # while steps run: a killed start loses at most about this much accounting


def process_start_time() -> float:
    """The `time.time()` at which this process started (Linux: from /proc, to ~10 ms); now where
    the process's start time cannot be read."""
    now = time.time()
    try:
        with open("/proc/self/stat") as f:  # field 22, starttime: clock ticks after boot
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age if 0 <= age < 10 * 365 * 86400 else now


class Ledger:
    """Where the time of one start goes, added to what earlier starts of the workdir recorded.

    `workdir=None` keeps time without reading or writing anything (processes other than 0).
    The stopwatch starts at `started_at` (default: now) in `startup`. Call `begin(step)` once the
    start's step is known (the restored checkpoint's, 0 for a fresh state), `switch(category)` or
    `with timing(category):` as the work changes, `step_done(step)` as steps finish,
    `checkpoint_saved(step)` after each save, `tick()` every step, and `end()` at the end.
    Nothing is written before the first `flush()`.
    """

    def __init__(
        self,
        workdir: str | None,
        *,
        started_at: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.path = os.path.join(workdir, FILE) if workdir is not None else None
        self._clock = clock
        now = clock()
        started_at = now if started_at is None else min(started_at, now)
        self._category, self._since = "startup", started_at
        self._start = _new_start(started_at, 0)
        self._earlier: list[dict] = []  # the workdir's earlier starts, as goodput.json held them
        self._last_flush = now
        self._write_failed = False

    # ------------------------------------------------------------------ the stopwatch
    def switch(self, category: str) -> str:
        """Charges the time since the last switch to the running category and runs `category`
        from now on; returns the category that was running."""
        if category not in CATEGORIES:
            raise UsageError(f"unknown goodput category {category!r}; use one of {CATEGORIES}")
        now = self._clock()
        previous = self._category
        self._start["seconds"][previous] += now - self._since
        self._category, self._since = category, now
        return previous

    @contextlib.contextmanager
    def timing(self, category: str):
        """Runs `category` inside the block, then the category that ran before it."""
        previous = self.switch(category)
        try:
            yield
        finally:
            self.switch(previous)

    # ------------------------------------------------------------------ steps and starts
    def begin(self, step: int) -> None:
        """This start trains from `step`. Earlier starts of the workdir (goodput.json) continue
        the ledger: the gap since the last one's last update is `restart`, and their steps after
        `step` are lost work (also when `step` is 0 and an earlier start died before its first
        checkpoint). Without a readable goodput.json the ledger starts anew."""
        self._start["first_step"] = self._start["last_step"] = int(step)
        self._earlier = self._read_earlier() if self.path else []
        if self._earlier:
            gap = self._start["started_at"] - self._earlier[-1]["ended_at"]
            # Below 0 only when two hosts' clocks disagree: that overlap then counts twice.
            self._start["seconds"]["restart"] = max(0.0, gap)
        self.rewind(step)

    def step_done(self, step: int) -> None:
        """Step `step` has finished (or, between logged steps, been dispatched)."""
        self._start["last_step"] = int(step)

    def checkpoint_saved(self, step: int) -> None:
        """A checkpoint of step `step` was saved: notes the productive time up to it (what a later
        restore of `step` keeps) and flushes."""
        self._settle()
        self._start["last_step"] = int(step)
        self._start["marks"][str(step)] = self._start["seconds"][PRODUCTIVE]
        self.flush()

    def rewind(self, step: int) -> None:
        """Training continues from the checkpoint of `step` (a restart, or a rollback within this
        start): the productive time of every start's steps after `step` moves to `lost`."""
        self._settle()
        for start in (*self._earlier, self._start):
            if start["last_step"] <= step:
                continue
            keep_to = max(step, start["first_step"])
            lost = start["seconds"][PRODUCTIVE] - _productive_at(start, keep_to)
            start["seconds"][PRODUCTIVE] -= lost
            start["seconds"]["lost"] += lost
            start["lost_steps"] += start["last_step"] - keep_to
            start["last_step"] = keep_to
            start["marks"] = {s: t for s, t in start["marks"].items() if int(s) <= keep_to}

    def tick(self, step: int) -> None:
        """Call every step (one clock read): flushes when the last flush is over a second old
        (without fsync: on the training thread each fsync took ~10 ms, up to 150 ms, here)."""
        if self._clock() - self._last_flush >= FLUSH_EVERY_S:
            self.step_done(step)
            self.flush(durable=False)

    # ------------------------------------------------------------------ reading it
    def seconds(self) -> dict[str, float]:
        """Seconds per category so far, over every start of the workdir."""
        self._settle()
        totals = dict.fromkeys(CATEGORIES, 0.0)
        for start in (*self._earlier, self._start):
            for name in CATEGORIES:
                totals[name] += start["seconds"][name]
        return totals

    def summary(self) -> dict:
        """The workdir's goodput so far: `fraction` (productive step time over wall time),
        `wall_sec`, `seconds` per category, `lost_steps`, `starts`, `restarts`, `step`."""
        seconds = self.seconds()
        wall = sum(seconds.values())
        starts = len(self._earlier) + 1
        return {
            "fraction": seconds[PRODUCTIVE] / wall if wall > 0 else 0.0,
            "wall_sec": wall,
            "seconds": seconds,
            "lost_steps": sum(s["lost_steps"] for s in (*self._earlier, self._start)),
            "starts": starts,
            "restarts": starts - 1,
            "step": self._start["last_step"],
        }

    def fraction(self) -> float:
        return self.summary()["fraction"]

    # ------------------------------------------------------------------ the file
    def flush(self, durable: bool = True) -> None:
        """Writes goodput.json whole (jddp/runtime/atomic_write.py: a crash leaves the old file
        or the new one; `durable`: fsynced, as at checkpoints and the end). A
        failed write is one warning, once: goodput is an account of the run, not part of it."""
        self._last_flush = self._clock()
        if self.path is None:
            return
        self._start["ended_at"] = self._settle()
        document = self.summary() | {
            "version": VERSION,
            "history": [*self._earlier, self._start],
        }
        try:
            atomic_write.write_json(self.path, document, indent=1, durable=durable)
        except OSError as e:
            if not self._write_failed:
                logging.warning("could not write %s: %s; goodput not recorded", self.path, e)
            self._write_failed = True

    def end(self) -> dict:
        """Flushes a last time and returns `summary()`."""
        self.flush()
        return self.summary()

    def _settle(self) -> float:
        """Charges the running category up to now (which goes on running); returns now."""
        self.switch(self._category)
        return self._since

    def _read_earlier(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        try:
            return _load(self.path)[1]
        except (OSError, ValueError, KeyError, TypeError) as e:
            logging.warning(
                "%s is unreadable or damaged (%s: %s); starting a new goodput ledger",
                self.path, type(e).__name__, e,
            )  # fmt: skip
            return []


def read(workdir: str) -> dict | None:
    """What `WORKDIR/goodput.json` holds: the `Ledger.summary()` keys of the run so far (over all
    its starts) and `history`, one entry per start (`started_at`, `ended_at`, `first_step`,
    `last_step`, `seconds`, `lost_steps`); None when the workdir has none. A damaged file is a
    WorkdirError."""
    path = os.path.join(workdir, FILE)
    if not os.path.exists(path):
        return None
    try:
        document, history = _load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WorkdirError(
            f"{path} is unreadable or damaged ({e}); the next start of the run writes a new one"
        ) from None
    return document | {"history": history}


def summary_of(workdir: str) -> dict | None:
    """`read(workdir)` without the per-start history: the keys of `Ledger.summary()`."""
    document = read(workdir)
    return {k: document[k] for k in SUMMARY_KEYS} if document else None


def summary_line(summary: dict) -> str:
    """One line of a `summary()`: "goodput 87%: steps 52.1 s, compile 3.2 s, ..., lost 2.0 s
    (10 steps redone), restart 4.0 s of 60.0 s wall over 2 starts". Categories under 0.05 s are
    left out, except `lost` when steps were redone and `restart` after a restart."""
    seconds, starts = summary["seconds"], summary["starts"]
    always = {"lost": summary["lost_steps"] > 0, "restart": starts > 1}  # even when brief
    parts = [f"steps {_sec(seconds[PRODUCTIVE])}"]
    for name in CATEGORIES:
        value = seconds[name]
        if name == PRODUCTIVE or (value < 0.05 and not always.get(name)):
            continue
        part = f"{name} {_sec(value)}"
        if name == "lost":
            redone = summary["lost_steps"]
            part += f" ({redone} step{'s' * (redone != 1)} redone)"
        parts.append(part)
    return (
        f"goodput {100 * summary['fraction']:.0f}%: {', '.join(parts)} of "
        f"{_sec(summary['wall_sec'])} wall over {starts} start{'s' * (starts != 1)}"
    )


def _sec(value: float) -> str:
    return f"{value:,.1f} s"


def _new_start(started_at: float, step: int) -> dict:
    return {
        "started_at": started_at,
        "ended_at": started_at,
        "first_step": step,
        "last_step": step,  # the last step whose work stands (cut back by a later rewind)
        "lost_steps": 0,  # steps this start did that were redone later
        "seconds": dict.fromkeys(CATEGORIES, 0.0),
        "marks": {},  # {checkpoint step: this start's productive seconds up to it}
    }


def _productive_at(start: dict, step: int) -> float:
    """`start`'s productive seconds up to `step`: exact at its first step and at the checkpoints
    it saved; between those, interpolated linearly (a checkpoint goodput.json never heard of)."""
    if step <= start["first_step"]:
        return 0.0
    marks = start["marks"]
    if str(step) in marks:
        return marks[str(step)]
    points = sorted(
        [(start["first_step"], 0.0), (start["last_step"], start["seconds"][PRODUCTIVE])]
        + [(int(s), t) for s, t in marks.items()]
    )
    for (s0, t0), (s1, t1) in zip(points, points[1:], strict=False):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0) if s1 > s0 else t1
    return points[-1][1]


def _load(path: str) -> tuple[dict, list[dict]]:
    """(goodput.json at `path`, the starts it records, checked field by field); ValueError,
    KeyError or TypeError when it is damaged."""
    with open(path) as f:
        document = json.load(f)
    if not isinstance(document, dict) or document.get("version") != VERSION:
        raise ValueError(f"not a goodput ledger of version {VERSION}")
    history = []
    for entry in document["history"]:
        start = _new_start(float(entry["started_at"]), int(entry["first_step"]))
        start |= {
            "ended_at": float(entry["ended_at"]),
            "last_step": int(entry["last_step"]),
            "lost_steps": int(entry["lost_steps"]),
            "seconds": {name: float(entry["seconds"][name]) for name in CATEGORIES},
            "marks": {str(int(s)): float(t) for s, t in entry["marks"].items()},
        }
        numbers = [start["started_at"], start["ended_at"], *start["seconds"].values()]
        if not all(math.isfinite(x) for x in numbers):
            raise ValueError("a number that is not finite")
        history.append(start)
    if not history:
        raise ValueError("no starts recorded")
    return document, history
