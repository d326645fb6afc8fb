"""Noticing that the scheduler wants the machines back (SIGTERM), or that the user pressed Ctrl-C
(SIGINT), at a step every process agrees on.

One process: a handler sets a flag the loop reads at the next step boundary, where it saves and
stops. A second Ctrl-C interrupts at once (Python's own KeyboardInterrupt), unless a save is
under way (below). Several processes:
JAX's preemption service (started by `jax.distributed.initialize`) catches SIGTERM in any process
and `multihost_utils.reached_preemption_sync_point` names the same step in all of them; Ctrl-C
there is left to Python, since the processes could not agree on a step to save.

During a checkpoint save (`saving()`) neither signal interrupts: a second SIGTERM or Ctrl-C lets
the save commit, then the run stops as interrupted (KeyboardInterrupt; the CLI's exit code 130).
"""

import contextlib
import os
import signal
import threading

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
    """`reached(step)` is True at the step where training should save and stop; `interrupted`
    says whether it was Ctrl-C (SIGINT) rather than a preemption (SIGTERM)."""

    def __init__(self):
        self._requested = threading.Event()
        self.interrupted = False
        self._previous = {}
        self._stopping = contextlib.ExitStack()  # the save-and-stop under way, once `reached`
        self._stop_held = False
        self._owns_sigterm = jax.process_count() == 1  # else JAX's preemption service has it
        if self._owns_sigterm and threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, *_) -> None:
        self._requested.set()

    def _on_sigint(self, *_) -> None:
        self.interrupted = True
        self._requested.set()
        # A second Ctrl-C stops at once, unsaved.
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))
        # os.write: the logging module's locks are not safe inside a signal handler.
        os.write(
            2,
            b"interrupt: saving a checkpoint at the end of this step, then stopping "
            b"(Ctrl-C again stops at once, unsaved; a save under way commits first)\n",
        )

    @contextlib.contextmanager
    def saving(self, what: str):
        """No SIGTERM or SIGINT interrupts `what` (a checkpoint save); one that came meanwhile
        takes effect after it: a second request to stop ends the run as interrupted."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        deferred = []

        def defer(signum, _frame):
            if not deferred:
                os.write(2, f"stopping once the {what} has committed\n".encode())
            deferred.append(signum)

        ours = (signal.SIGINT, signal.SIGTERM) if self._owns_sigterm else (signal.SIGINT,)
        previous = {signum: signal.signal(signum, defer) for signum in ours}
        try:
            yield
        except BaseException:
            self._restore(previous, deferred)
            raise
        self._restore(previous, deferred)
        if deferred and not self._owns_sigterm:  # Python's own Ctrl-C, only later
            raise KeyboardInterrupt(f"after the {what} committed")

    def _restore(self, previous: dict, deferred: list) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if deferred and self._owns_sigterm:
            if self._requested.is_set() or signal.SIGINT in deferred:  # told twice, or Ctrl-C
                self.interrupted = True
            self._requested.set()

    def reached(self, step: int) -> bool:
        """Whether to save and stop at `step`; from then on until `close()`, signals wait for
        the save (`saving`)."""
        if jax.process_count() > 1:
            try:
                reached = multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # the preemption service is off
                reached = False
        else:
            reached = self._requested.is_set()
        if reached and not self._stop_held:
            self._stop_held = True
            self._stopping.enter_context(self.saving(f"checkpoint save of step {step}"))
        return reached

    def close(self) -> None:
        try:
            self._stopping.close()  # a signal that came meanwhile takes effect now
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            self._previous = {}
