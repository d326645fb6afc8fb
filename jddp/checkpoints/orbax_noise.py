"""Keeps orbax's echoes of a failure `Checkpoints` has already reported off the console: orbax
logs a failed write from each thread it passes through, asyncio reports its unawaited tasks, and
after a failed read the reads orbax left in flight end in "Event loop is closed" and ~60-line
"Exception ignored in" reports. `FAILURES_REPORTED`, held from a `Checkpoints`' construction to
its `close()`, drops exactly those; everything else still reaches the console."""

import gc
import inspect
import logging as std_logging
import os
import time
import weakref

from jddp.runtime import quiet
from jddp.runtime.fs import write_failure

# How long `Checkpoints.close` waits for the reads orbax abandoned after a failed one to end (they
# end when tensorstore finishes them), so that their reports are dropped while its filters are in
# place.
ABANDONED_READS_WAIT_S = 60

# Checkpoint directories `restore_latest` reads: it reports every failure to read them, damage
# in a warning and the rest in a CheckpointError.
reported_reads: set[str] = set()


class _ReportedFailures(std_logging.Filter):
    """orbax logs a failed write, traceback and all, from each thread it passes through, and
    asyncio reports a failed write or read once more for each of orbax's tasks nobody awaited
    ("Task exception was never retrieved", when the garbage collector gets to them). The
    CheckpointError that `Checkpoints` raises, or its warning about a damaged checkpoint, says it
    once, in one line: these records are dropped."""

    def filter(self, record) -> bool:
        from_orbax = "/orbax/" in record.pathname or record.name == "asyncio"
        if not from_orbax or record.levelno < std_logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        failed_write = error is not None and write_failure(error) is not None
        text = f"{record.getMessage()} {error}"
        failed_read = any(directory in text for directory in reported_reads)
        return not (failed_write or failed_read or "os_error_code=" in record.getMessage())


def _is_closed_loop(unraisable) -> bool:
    """After a failed read, tensorstore finishes the reads still in flight and hands each result
    to the event loop orbax has already closed; each hand-off ends in a `RuntimeError: Event loop
    is closed` printed through `sys.unraisablehook`."""
    error = unraisable.exc_value
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _is_abandoned_read(unraisable) -> bool:
    """A read orbax left in flight after a failed one, of a checkpoint `restore_latest` has
    reported, closed by the garbage collector: orbax turns the close (GeneratorExit) into a
    ~60-line "Exception ignored in: <coroutine object _read_array_index_and_device_put>"."""
    coroutine, text = unraisable.object, str(unraisable.exc_value)
    return (
        inspect.iscoroutine(coroutine)
        and _is_orbax(coroutine)
        and any(directory in text for directory in reported_reads)
    )


# While held, the failures `Checkpoints` reports itself are not reported again on the console.
FAILURES_REPORTED = quiet.together(
    quiet.log_filter(("absl", "asyncio"), _ReportedFailures()),
    quiet.drop_unraisable(lambda report: _is_closed_loop(report) or _is_abandoned_read(report)),
)


def suspended_reads() -> list[weakref.ref]:
    """orbax's coroutines still suspended (reads tensorstore has in flight), weakly."""
    return [
        weakref.ref(o)
        for o in gc.get_objects()
        if inspect.iscoroutine(o) and o.cr_frame is not None and _is_orbax(o)
    ]


def _is_orbax(coroutine) -> bool:
    return f"{os.sep}orbax{os.sep}" in coroutine.cr_code.co_filename


def wait_for_abandoned_reads(abandoned_reads: list[weakref.ref]) -> None:
    """After a failed read, orbax leaves the reads still in flight to tensorstore; each is
    reported (a ~60-line "Exception ignored in: <coroutine object
    _read_array_index_and_device_put>", and asyncio's "Task exception was never retrieved")
    when it ends and the garbage collector reaches it. Waits for that (`abandoned_reads`: from
    `suspended_reads`), while those reports are still dropped (at most ABANDONED_READS_WAIT_S)."""
    deadline = time.monotonic() + ABANDONED_READS_WAIT_S
    while abandoned_reads:
        gc.collect()
        abandoned_reads = [r for r in abandoned_reads if r() is not None]
        if not abandoned_reads or time.monotonic() > deadline:
            break
        time.sleep(0.05)
