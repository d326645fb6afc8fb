"""Keeping libraries' expected chatter out of the user's terminal, for one scope at a time."""

import contextlib
import io
import logging


class _BelowError(logging.Filter):
    def __init__(self, path_fragment: str):
        super().__init__()
        self.path_fragment = path_fragment

    def filter(self, record) -> bool:
        return self.path_fragment not in record.pathname or record.levelno >= logging.ERROR


@contextlib.contextmanager
def library_warnings_muted(package: str, *, stdout: bool = False):
    """Within the scope, `package`'s log records below ERROR are dropped (they reach absl's
    logger, where jddp's own log lines go too) and, with `stdout`, so are its prints."""
    mute, absl_logger = _BelowError(f"/{package}/"), logging.getLogger("absl")
    absl_logger.addFilter(mute)
    try:
        with contextlib.redirect_stdout(io.StringIO()) if stdout else contextlib.nullcontext():
            yield
    finally:
        absl_logger.removeFilter(mute)
