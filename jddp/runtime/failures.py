"""What `jddp-launch` does after a start ended (`Restarts`: the exit-code contract of
jddp/errors.py) and what it says about a start that failed: which process, how, and for a hang
which process had fallen behind the others (from the lines jddp/runtime/watchdog.py prints)."""

import dataclasses
import re
import signal
import time

from jddp.errors import INTERRUPTED_EXIT_CODE, RETRYABLE_EXIT_CODE
from jddp.errors import MISTAKE_EXIT_CODE as USAGE_EXIT_CODE
from jddp.runtime.heartbeat import Silence
from jddp.runtime.job import HANG_EXIT_CODE, Outcome

# Restarts after a retryable end (75) or to grow that --max_restarts does not count, in a row;
# past them each takes one of --max_restarts, so that neither can restart a job forever.
FREE_IN_A_ROW = 5
# A start that ran this long ends the row (the kubelet forgets a crash back-off after 10 minutes).
LONG_RUN_S = 600.0
# Before the n-th retry in a row: RETRY_DELAY_S * 2**(n-1), at most MAX_RETRY_DELAY_S (1, 2, 4,
# 8, 16 s: a dying run lets go of the workdir's lock, a file system comes back).
RETRY_DELAY_S, MAX_RETRY_DELAY_S = 1.0, 60.0

_DISPATCHED = re.compile(r"last dispatched: train step (\d+)")
_FINISHED = re.compile(r"after step (\w+)")
_STACKS = re.compile(r"stack is in (\S+)$")


def describe_code(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def exit_code(code: int) -> int:
    """The launcher's exit code for a child's: a signal as shells report it (128 + number)."""
    return code if code > 0 else 128 - code


@dataclasses.dataclass(frozen=True)
class Decision:
    """What follows a failed start: a restart (`counted` against --max_restarts or not, after
    `delay_s`), or the launcher's end with `exit_code`."""

    restart: bool
    exit_code: int = 0
    counted: bool = False
    delay_s: float = 0.0


class Restarts:
    """The launcher's answer to each way a start ends, as jddp/errors.py's contract has it:

    - 2, a mistake: never restarted;
    - 130, interrupted: never restarted;
    - 75, retryable: restarted after a back-off without counting, FREE_IN_A_ROW times in a
      row; past that each takes one of --max_restarts;
    - any other code (a crash, a kill, a hang): takes one of --max_restarts (torchrun's count);
    - a stop to grow (more slots): free like a retry, then counted, then not done.

    The row ends when a start has run LONG_RUN_S; --max_restarts is never given back."""

    def __init__(self, max_restarts: int, clock=time.monotonic):
        self.max_restarts, self.counted = max_restarts, 0
        self.free_in_a_row, self.retries_in_a_row = 0, 0
        self._clock = clock
        self._started = clock()

    def start(self) -> None:
        """Called as each start begins: its running time may end the row."""
        self._started = self._clock()

    def after(self, code: int) -> Decision:
        """The decision for a start whose first failed process ended with `code` (a signal
        as the shell has it: 128 + its number)."""
        self._forget_row_after_a_long_run()
        if code in (USAGE_EXIT_CODE, INTERRUPTED_EXIT_CODE):
            return Decision(restart=False, exit_code=code)
        delay = 0.0
        if code == RETRYABLE_EXIT_CODE:
            self.retries_in_a_row += 1
            delay = min(MAX_RETRY_DELAY_S, RETRY_DELAY_S * 2 ** (self.retries_in_a_row - 1))
            if self._free():
                return Decision(restart=True, delay_s=delay)
        if self.counted < self.max_restarts:
            self.counted += 1
            return Decision(restart=True, counted=True, delay_s=delay)
        return Decision(restart=False, exit_code=code)

    def grow(self) -> bool:
        """Whether the job may be stopped now to start again on more processes (if so, that
        restart is taken from the budget)."""
        self._forget_row_after_a_long_run()
        if self._free():
            return True
        if self.counted < self.max_restarts:
            self.counted += 1
            return True
        return False

    def _free(self) -> bool:
        if self.free_in_a_row < FREE_IN_A_ROW:
            self.free_in_a_row += 1
            return True
        return False

    def _forget_row_after_a_long_run(self) -> None:
        if self._clock() - self._started >= LONG_RUN_S:
            self.free_in_a_row = self.retries_in_a_row = 0


def what_failed(outcome: Outcome, nproc: int) -> str:
    """`process 1 of 2 failed (killed by SIGKILL)`, or for a hang the processes behind, or the
    process that stopped making progress without its watchdog getting to run."""
    rank, code = outcome.failed, outcome.codes[outcome.failed]
    if outcome.silent is not None and outcome.silent.rank == rank:
        return _silent(outcome.silent, nproc)
    if code == HANG_EXIT_CODE and _STACKS.search(outcome.errors.get(rank, "")):
        return _hang(outcome, nproc)
    return f"process {rank} of {nproc} failed ({describe_code(code)})"


def _hang(outcome: Outcome, nproc: int) -> str:
    """Names the processes whose hang watchdog fired while the others had gone further, or, when
    none had, those that never reported; with their stack files."""
    reached, finished, stacks = {}, {}, {}
    for rank, line in outcome.errors.items():
        found = _STACKS.search(line)
        if not found:
            continue
        stacks[rank] = found.group(1)
        dispatched = _DISPATCHED.search(line)
        reached[rank] = int(dispatched.group(1)) if dispatched else -1
        finished[rank] = _FINISHED.search(line).group(1)
    furthest = max(reached.values())
    behind = sorted(rank for rank, step in reached.items() if step < furthest)
    silent = sorted(set(range(nproc)) - set(reached))
    if behind:
        who = _processes(behind, nproc)
        files = ", ".join(stacks[rank] for rank in behind)
        return (
            f"hang: {who} had not reached train step {furthest}, which the others had "
            f"(stacks: {files})"
        )
    if silent:
        return (
            f"hang: {_processes(silent, nproc)} never reported (stuck without its watchdog "
            f"getting to run); the others waited in train step {furthest} (stacks: "
            f"{', '.join(stacks.values())})"
        )
    return (
        f"hang: every process stopped after step {min(finished.values())}: one is stuck inside "
        "the next step (on its devices or in a host callback) while the others wait for it in a "
        "collective "
        f"(stacks: {', '.join(stacks[rank] for rank in sorted(stacks))})"
    )


_STATES = {  # /proc/PID/stat's state letter, of a process that makes no progress
    "T": "it is stopped (SIGSTOP, or Ctrl-Z)",
    "t": "it is stopped by a debugger",
    "D": "it waits inside the kernel (a disk, a network file system or a driver)",
    "Z": "it is exiting",
}


def _silent(silent: Silence, nproc: int) -> str:
    """A process that could not run its own watchdog, as the launcher found it."""
    state = _STATES.get(
        silent.state, "it runs, but its watchdog thread cannot (held by native code?)"
    )
    if silent.silent_s is None:  # a peer failed first, having lost it
        return f"hang: process {silent.rank} of {nproc} stopped making progress: {state}"
    return (
        f"hang: process {silent.rank} of {nproc} stopped making progress: no heartbeat from its "
        f"watchdog for {silent.silent_s:.0f} s (its bound: {silent.bound_s:g} s); {state}; "
        "killed it, no stacks (it could not write them)"
    )


def _processes(ranks: list[int], nproc: int) -> str:
    if len(ranks) == 1:
        return f"process {ranks[0]} of {nproc}"
    return f"processes {', '.join(map(str, ranks))} of {nproc}"
