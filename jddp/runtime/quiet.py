"""Keeping libraries' expected chatter out of the user's terminal, while a call needs it and
no longer: a library leaves its user's process as it found it.

A change to the process (a log filter, a wrapper around `sys.unraisablehook` or
`threading.excepthook`) is shared by its holders: made when the first acquires it, undone when
the last releases it, from any thread and in any order (two checkpoint managers open at once
share one). jddp's own programs hold theirs until the process ends (`hold_for_process`)."""

import contextlib
import io
import logging
import sys
import threading
from collections.abc import Callable

from absl import logging as absl_logging

_lock = threading.RLock()


class SharedChange:
    """A change to the process made by `make()` (which returns its undo), in place while anyone
    holds it: between `acquire()` and `release()`, or within `held()`."""

    def __init__(self, make: Callable[[], Callable[[], None]]):
        self._make = make
        self._holders = 0
        self._undo = None

    def acquire(self) -> None:
        with _lock:
            if not self._holders:
                self._undo = self._make()
            self._holders += 1

    def release(self) -> None:
        with _lock:
            self._holders -= 1
            if not self._holders:
                undo, self._undo = self._undo, None
                undo()

    @contextlib.contextmanager
    def held(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()


def together(*changes: SharedChange) -> SharedChange:
    """`changes`, held and let go as one."""

    def make():
        for change in changes:
            change.acquire()
        return lambda: [change.release() for change in reversed(changes)]

    return SharedChange(make)


def log_filter(logger_names: tuple[str, ...], keep: logging.Filter) -> SharedChange:
    """`keep` on the loggers named, while held."""

    def make():
        loggers = [logging.getLogger(name) for name in logger_names]
        for logger in loggers:
            logger.addFilter(keep)
        return lambda: [logger.removeFilter(keep) for logger in loggers]

    return SharedChange(make)


class _Drops:
    """One wrapper around a hook (`sys.unraisablehook`, `threading.excepthook`) that drops the
    reports some current `expected` predicate accepts and hands the rest to the hook it found;
    in place only while there are predicates. Taken out, it gives back the hook it found, unless
    another wrapper was put over it since: then it stays, passing every report through."""

    def __init__(self, owner, hook_name: str):
        self.owner, self.hook_name = owner, hook_name
        self.expected: list[Callable] = []
        self.hook = None

    def add(self, expected: Callable) -> Callable[[], None]:
        with _lock:
            if not self.expected:
                self._install()
            self.expected.append(expected)

        def remove():
            with _lock:
                self.expected.remove(expected)
                if not self.expected:
                    self._uninstall()

        return remove

    def _install(self) -> None:
        found, expected = getattr(self.owner, self.hook_name), self.expected

        def hook(report):
            if not any(is_expected(report) for is_expected in list(expected)):
                found(report)

        hook.found = found
        self.hook = hook
        setattr(self.owner, self.hook_name, hook)

    def _uninstall(self) -> None:
        if getattr(self.owner, self.hook_name) is self.hook:
            setattr(self.owner, self.hook_name, self.hook.found)
        self.expected = []  # a wrapper left under another one drops nothing more
        self.hook = None


_unraisable = _Drops(sys, "unraisablehook")
_thread_errors = _Drops(threading, "excepthook")


def drop_unraisable(is_expected: Callable) -> SharedChange:
    """While held, exceptions Python reports as unraisable (`sys.unraisablehook`: from
    finalizers, atexit callbacks, C callbacks) for which `is_expected(unraisable)` holds are
    dropped; the others reach the hook that was in place."""
    return SharedChange(lambda: _unraisable.add(is_expected))


def drop_thread_errors(is_expected: Callable) -> SharedChange:
    """`drop_unraisable` for exceptions that end threads (`threading.excepthook`)."""
    return SharedChange(lambda: _thread_errors.add(is_expected))


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


def _library_info_kept_out():
    def keep(record) -> bool:
        noisy = "/orbax/" in record.pathname or "/tensorflow_datasets/" in record.pathname
        return record.levelno >= logging.WARNING or not noisy

    handlers = {*logging.getLogger().handlers, absl_logging.get_absl_handler()}
    for handler in handlers:
        handler.addFilter(keep)
    # JAX logs at INFO that it found no TPU: noise on every CPU and GPU run.
    xla_bridge = logging.getLogger("jax._src.xla_bridge")
    level = xla_bridge.level
    xla_bridge.setLevel(logging.WARNING)

    def undo():
        for handler in handlers:
            handler.removeFilter(keep)
        xla_bridge.setLevel(level)

    return undo


LIBRARY_INFO_KEPT_OUT = SharedChange(_library_info_kept_out)


def hold_for_process(*changes: SharedChange) -> None:
    """Holds `changes` until the process ends: for jddp's own programs, which own it (reports
    that come late, when the garbage collector or an atexit callback gets to them, stay out)."""
    for change in changes:
        change.acquire()


def quiet_library_logs() -> None:
    """Keeps orbax's per-save and TFDS's per-read INFO chatter out of the training log
    (their warnings still show), until the process ends: for jddp's own programs."""
    hold_for_process(LIBRARY_INFO_KEPT_OUT)
