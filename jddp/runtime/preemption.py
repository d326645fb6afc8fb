"""Noticing that the scheduler wants the machines back (SIGTERM), at a step every process agrees on.

One process: a SIGTERM handler sets a flag the loop reads at the next step boundary. Several
processes: JAX's preemption service (started by `jax.distributed.initialize`) catches SIGTERM in
any process and `multihost_utils.reached_preemption_sync_point` names the same step in all of them.
"""

import signal
import threading

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
    """`reached(step)` is True at the step where training should save and stop."""

    def __init__(self):
        self._requested = threading.Event()
        self._previous = None
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self._requested.set())

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            try:
                return multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # the preemption service is off
                return False
        return self._requested.is_set()

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
