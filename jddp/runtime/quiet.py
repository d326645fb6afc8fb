"""Keeping libraries' expected chatter out of the user's terminal: for one scope at a time, or
for the whole process in jddp's own programs (`quiet_library_logs`)."""

import contextlib
import io
import logging
import sys
import threading

from absl import logging as absl_logging


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


def _drop(owner, hook_name: str, name: str, is_expected) -> None:
    previous = getattr(owner, hook_name)
    installed = getattr(previous, "jddp_drops", ())
    if name in installed:
        return

    def hook(report):
        if not is_expected(report):
            previous(report)

    hook.jddp_drops = (*installed, name)
    setattr(owner, hook_name, hook)


def drop_unraisable(name: str, is_expected) -> None:
    """From now on, exceptions Python reports as unraisable (`sys.unraisablehook`: from
    finalizers, atexit callbacks, C callbacks) pass `is_expected(unraisable)` before they print;
    the expected ones are dropped. Installed once per `name`."""
    _drop(sys, "unraisablehook", name, is_expected)


def drop_thread_errors(name: str, is_expected) -> None:
    """`drop_unraisable` for exceptions that end threads (`threading.excepthook`)."""
    _drop(threading, "excepthook", name, is_expected)


def quiet_library_logs() -> None:
    """Keeps orbax's per-save and TFDS's per-read INFO chatter out of the training log
    (their warnings still show), from now on: for jddp's own programs, which own the process."""

    def keep(record) -> bool:
        noisy = "/orbax/" in record.pathname or "/tensorflow_datasets/" in record.pathname
        return record.levelno >= logging.WARNING or not noisy

    for handler in {*logging.getLogger().handlers, absl_logging.get_absl_handler()}:
        handler.addFilter(keep)
    # JAX logs at INFO that it found no TPU: noise on every CPU and GPU run.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
