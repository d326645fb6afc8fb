"""Typed errors, each a one-line message naming the problem and the fix, and the exit codes jddp's
programs end with: a contract `jddp-launch`, `launch/slurm.sbatch` and `launch/kubernetes.yaml`
act on (the table, with what each of them does, is in docs/errors.md).

    0    done
    2    a mistake in the command, config or data: never retried, it would fail the same way
    75   retryable (EX_TEMPFAIL): transient I/O, a lock held by a live or dying run, a lost peer,
         a preemption that was saved; the same command, run again, resumes
    130  interrupted (Ctrl-C, or a second SIGTERM once the save had finished)
    else a failure: retried up to --max_restarts

Each error class maps to one code, its `exit_code`: a `JddpError` is a mistake (2) unless it is
also a `RetryableError` (75).
"""

MISTAKE_EXIT_CODE = 2
RETRYABLE_EXIT_CODE = 75
INTERRUPTED_EXIT_CODE = 130


def first_line(error: BaseException, limit: int = 160) -> str:
    """The first line of `error`'s text, cut to `limit` characters (with "..."): what a one-line
    error quotes of another library's failure."""
    line = (str(error).strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


class JddpError(ValueError):
    """Base class for every user-facing jddp error: by default a mistake (exit code 2)."""

    exit_code = MISTAKE_EXIT_CODE


class ConfigError(JddpError):
    """A config value is missing, out of range or inconsistent."""


class DataError(JddpError):
    """A dataset is unknown, missing, corrupt, or does not fit the model."""


class ShapeError(JddpError):
    """A batch, loss or model output has the wrong shape."""


class WorkdirError(JddpError):
    """The workdir cannot be used as asked."""


class CheckpointError(JddpError):
    """A checkpoint cannot be read or written, or does not fit the model."""


class UsageError(JddpError):
    """The library was called out of order or with the wrong kind of argument."""


class TrainingHalted(JddpError):
    """Training stopped on purpose (non-finite loss or gradients under nan_policy=halt)."""


class RetryableError(JddpError):
    """Something outside the command failed in a way a later try may get past (exit code 75)."""

    exit_code = RETRYABLE_EXIT_CODE


class WorkdirBusy(WorkdirError, RetryableError):
    """The workdir's lock is held by another run (live, or dying and about to let go)."""


class CheckpointUnreadable(CheckpointError, RetryableError):
    """A checkpoint could not be read for a reason that is not damage to its files (I/O,
    memory, permissions, a step being written or pruned); every file was left where it was."""


class DataUnreadable(DataError, RetryableError):
    """Data could not be read for a reason a later try may get past (a flaky file system)."""
