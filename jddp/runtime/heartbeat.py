"""The heartbeat between a training process's hang watchdog and `jddp-launch`. A process whose
watchdog cannot run (stopped with SIGSTOP, frozen, its interpreter held inside native code)
cannot end itself: its launcher ends it.

The launcher names one file per process in the environment (`JDDP_HEARTBEAT_FILE`); the
watchdog's thread rewrites it about once a second with the seconds of silence after which the
launcher gives up on the process (its hang bound), and removes it when training ends. No file,
no watch: a process is watched from its training loop's start to its end. Standard library only:
the launcher does not import JAX.
"""

import dataclasses
import os
import shutil
import tempfile
import time

ENV = "JDDP_HEARTBEAT_FILE"
STOPPED = ("T", "t")  # /proc states: stopped by a signal, by a debugger
_WIDTH = 24  # bytes of every beat: rewritten in place, never shorter (no truncation to race)


class Beat:
    """The writing end, in the training process: `beat(bound_s)` says "alive; end me after
    `bound_s` seconds without another beat"."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)

    @classmethod
    def from_env(cls) -> "Beat | None":
        """The beat the launcher asked for, or None when no launcher watches this process."""
        path = os.environ.get(ENV)
        if not path:
            return None
        try:
            return cls(path)
        except OSError:  # the launcher's directory is gone: it cannot watch us anyway
            return None

    def beat(self, bound_s: float) -> None:
        try:
            os.pwrite(self._fd, f"{bound_s:.3f}".ljust(_WIDTH - 1).encode() + b"\n", 0)
        except OSError:
            pass

    def close(self) -> None:
        """Training is over: no longer watched."""
        os.close(self._fd)
        try:
            os.unlink(self.path)
        except OSError:
            pass


@dataclasses.dataclass(frozen=True)
class Silence:
    """A process that stopped making progress: `rank`, its state in /proc ("T": stopped; ""
    where unknown) and, when its heartbeat ran past its bound, the seconds since its last beat
    and that bound."""

    rank: int
    state: str
    silent_s: float | None = None
    bound_s: float | None = None


class Watch:
    """The reading end, in the launcher: one file per rank in a directory of its own. Each file's
    changes are timed with the launcher's monotonic clock (a wall-clock step is no silence)."""

    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="jddp-heartbeats-")
        self._seen = {}  # rank: (the file's mtime_ns, monotonic time it was seen, bound)

    def path(self, rank: int) -> str:
        return os.path.join(self.directory, str(rank))

    def env(self, rank: int, env: dict) -> dict:
        return {**env, ENV: self.path(rank)}

    def silent(self, pids: dict[int, int]) -> Silence | None:
        """The first of the running processes (`{rank: pid}`) silent past its bound, if any."""
        now = time.monotonic()
        for rank, pid in pids.items():
            try:
                mtime = os.stat(self.path(rank)).st_mtime_ns
            except OSError:  # not (or no longer) in its training loop
                self._seen.pop(rank, None)
                continue
            seen = self._seen.get(rank)
            if seen is None or seen[0] != mtime:
                bound = _read_bound(self.path(rank))
                if bound is None:  # being written for the first time: next look
                    continue
                self._seen[rank] = seen = (mtime, now, bound)
            if now - seen[1] > seen[2]:
                return Silence(rank, process_state(pid), now - seen[1], seen[2])
        return None

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _read_bound(path: str) -> float | None:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> str:
    """The state letter of process `pid` in /proc (Linux): "T" stopped (SIGSTOP), "t" stopped by
    a debugger, "D" waiting on the disk or a driver, "R", "S"...; "" where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def stopped(pids: dict[int, int]) -> Silence | None:
    """The first process among `{rank: pid}` that is stopped (SIGSTOP or a debugger)."""
    for rank, pid in pids.items():
        state = process_state(pid)
        if state in STOPPED:
            return Silence(rank, state)
    return None
