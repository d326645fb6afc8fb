"""Typed errors for user mistakes: each message is one line naming the problem and the fix.

The CLI turns any `JddpError` into that line on stderr and exit code 2, without a traceback.
"""


class JddpError(ValueError):
    """Base class for every user-facing jddp error."""


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
