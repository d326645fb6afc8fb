"""Verdicts on a failed read of a checkpoint, from its files and never from the error's text:
damage (`jddp/checkpoints/damage.py` proves it), or a failure to read that leaves every file
where it is (a CheckpointUnreadable); and the collectives through which every process agrees on
one verdict and on one list of steps."""

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from jddp.checkpoints import damage
from jddp.errors import CheckpointError, CheckpointUnreadable, first_line

# What a failed read of a checkpoint is, agreed by every process: the worst one found counts.
READ, DAMAGED, UNREADABLE = 0, 1, 2


def judge(source: str, error: Exception) -> tuple[int, str]:
    """(DAMAGED, what in its files shows it) or (UNREADABLE, the one line to raise) for a
    failed read of checkpoint `source` (a step directory), from its files, not from `error`'s
    text."""
    summary = f"{type(error).__name__}: {first_line(error)}"
    try:
        problem = damage.damage_in(source)
    except OSError as e:
        problem = e
    if not os.path.isdir(source):
        return UNREADABLE, (
            f"checkpoint {source} was removed while it was read (the run holding the workdir "
            "prunes its older checkpoints); run the same command again to read the newest"
        )
    if isinstance(problem, OSError):
        return UNREADABLE, (
            f"could not read checkpoint {source} ({summary}; {problem.strerror}: "
            f"{problem.filename}), which is not damage to its files: nothing was moved; fix the "
            "cause and run the same command again"
        )
    if problem is None:
        return UNREADABLE, (
            f"could not read checkpoint {source} ({summary}), though its files are complete: "
            "not damage, so nothing was moved; fix the cause and run the same command again"
        )
    return DAMAGED, problem


def read_failure(source: str, error: Exception) -> CheckpointError:
    """The one-line error for a failed read of checkpoint `source` by a reader, which moves
    nothing: damage (a CheckpointError), or a CheckpointUnreadable."""
    verdict, reason = judge(source, error)
    if verdict == DAMAGED:
        return CheckpointError(
            f"checkpoint {source} is damaged ({reason}); it was left where it is (the run "
            "holding the workdir sets it aside when it starts); read an earlier step"
        )
    return CheckpointUnreadable(reason)


def gathered(value: int) -> list[int]:
    """`value` of every process, by process index (through the coordinator's collectives)."""
    if jax.process_count() == 1:
        return [value]
    gathered = multihost_utils.process_allgather(np.array([value], np.int32))
    return [int(v) for v in np.asarray(gathered).reshape(-1)]


def agreed_steps(steps: list[int]) -> list[int]:
    """Process 0's `steps` on every process: a reader beside a live run may list the directory
    a moment apart from the others."""
    if jax.process_count() == 1:
        return list(steps)
    count = int(multihost_utils.broadcast_one_to_all(np.int32(len(steps))))
    padded, known = np.zeros(count, np.int64), min(count, len(steps))
    padded[:known] = steps[:known]
    return [int(s) for s in multihost_utils.broadcast_one_to_all(padded)]


def agreed_verdict(verdict: int, reason: str, source: str) -> tuple[int, str]:
    """(the worst of every process's verdicts on reading checkpoint `source`, its reason): this
    process's `reason`, or which process found the damage. Raises the CheckpointUnreadable when
    any process failed to read it for another reason than damage."""
    verdicts = gathered(verdict)
    worst = max(verdicts)
    if worst == UNREADABLE:
        if verdict != UNREADABLE:
            reason = (
                f"process {verdicts.index(UNREADABLE)} could not read checkpoint {source} (its "
                "log says why); nothing was moved; run the same command again"
            )
        raise CheckpointUnreadable(reason) from None
    if worst == DAMAGED:
        return worst, reason or f"process {verdicts.index(DAMAGED)} found it so"
    return worst, reason
