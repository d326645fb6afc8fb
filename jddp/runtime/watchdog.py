"""`HangWatchdog`: a job whose training steps stop finishing ends, with every thread's stack on
disk and one line on stderr, instead of hanging until someone notices.

A daemon thread watches the outputs of the dispatched steps with `jax.Array.is_ready`, which
never blocks. Once the first step has finished (compiling it may take any time), if `timeout_s`
pass without another step finishing while the main thread is not in a pause (an evaluation pass,
a checkpoint save: host work that is not a step and may take long), the thread writes every
thread's stack to WORKDIR/hang-<process>.txt, logs the last finished step and what was last
dispatched, prints one line and ends the process with `os._exit`: the main thread is then
typically blocked inside a collective in C, where neither an exception nor a signal handler would
run. Every process has its own watchdog; a process waiting in a collective for a hung peer fires
too: both count from the same last finished step, and a process that fires waits a grace period
(two polls and a second) before it exits, because a peer's collective fails at once when it does,
before the peer's own watchdog would have written its stacks.
"""

import collections
import contextlib
import faulthandler
import os
import sys
import threading
import time

import jax
from absl import logging

EXIT_CODE = 3


class HangWatchdog:
    """Ends the process when no step finishes for `timeout_s` seconds after the first one."""

    def __init__(self, timeout_s: float, workdir: str, process_index: int | None = None):
        self.timeout_s = float(timeout_s)
        index = jax.process_index() if process_index is None else process_index
        self.path = os.path.join(os.path.abspath(workdir), f"hang-{index}.txt")
        self._lock = threading.Lock()
        self._pending = collections.deque()  # (step, an output of that step), oldest first
        self._finished_step = None
        self._progress_at = None  # when a step last finished or a pause ended; None: unarmed
        self._pause = None
        self._last_dispatched = "nothing"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jddp-hang-watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, timeout_s: float, workdir: str):
        """A running watchdog, or one that does nothing when `timeout_s` is 0."""
        return cls(timeout_s, workdir) if timeout_s > 0 else _Off()

    def dispatching(self, step: int) -> None:
        """Step `step` is being dispatched (on CPU a dispatch can block in a collective)."""
        with self._lock:
            self._last_dispatched = f"train step {step}"

    def dispatched(self, step: int, output: jax.Array) -> None:
        """Step `step` was dispatched; it has finished when `output` is ready."""
        with self._lock:
            self._pending.append((step, output))
            self._last_dispatched = f"train step {step}"

    @contextlib.contextmanager
    def paused(self, what: str):
        """No alarm while the main thread does `what`; the clock restarts when it is done."""
        with self._lock:
            self._pause = self._last_dispatched = what
        try:
            yield
        finally:
            with self._lock:
                self._pause = None
                if self._progress_at is not None:
                    self._progress_at = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        poll = min(1.0, max(0.05, self.timeout_s / 10))
        self._grace = 2 * poll + 1 if jax.process_count() > 1 else 0.0
        while not self._stop.wait(poll):
            with self._lock:
                now = time.monotonic()
                while self._pending and self._pending[0][1].is_ready():
                    self._finished_step = self._pending.popleft()[0]
                    self._progress_at = now
                waiting = self._progress_at is not None and self._pause is None
                idle = now - self._progress_at if waiting else 0.0
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        with self._lock:
            step, last = self._finished_step, self._last_dispatched
        where = f"no training step finished for {idle:.0f} s after step {step}"
        try:
            with open(self.path, "w") as f:
                f.write(f"{where} (timeout {self.timeout_s:g} s); last dispatched: {last}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            stacks = f"every thread's stack is in {self.path}"
        except OSError as e:
            stacks = f"could not write the stacks to {self.path} ({e.strerror})"
        logging.error("hang: %s; last dispatched: %s; %s", where, last, stacks)
        print(
            f"error: {where} (hang_timeout_s={self.timeout_s:g}); last dispatched: {last}; "
            f"{stacks}",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(self._grace)
        os._exit(EXIT_CODE)


class _Off:
    """The watchdog of `hang_timeout_s=0`: every call does nothing."""

    def dispatching(self, step) -> None:
        pass

    def dispatched(self, step, output) -> None:
        pass

    @contextlib.contextmanager
    def paused(self, what):
        yield

    def close(self) -> None:
        pass
