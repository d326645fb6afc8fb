"""What `jddp-launch` says about a start that failed: which process, how, and for a hang which
process had fallen behind the others (from the lines jddp/runtime/watchdog.py prints)."""

import re
import signal

from jddp.errors import MISTAKE_EXIT_CODE as USAGE_EXIT_CODE
from jddp.runtime.heartbeat import Silence
from jddp.runtime.job import HANG_EXIT_CODE, Outcome

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


def restartable(outcome: Outcome) -> bool:
    """Whether starting again may help: not for a user mistake (exit code 2)."""
    return outcome.codes[outcome.failed] != USAGE_EXIT_CODE


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
