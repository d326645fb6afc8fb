"""gloo's polling thread, put behind the threads that compute.

XLA's gloo TCP transport runs one event-loop thread per process that keeps polling its sockets
while a collective is in flight. On a core that thread shares with the thread running the step
(a process pinned to one core, or more processes than cores), Linux lets the poller run out its
time slice before the woken step thread gets the core back, which adds a millisecond or more to
every collective (gloo, 2 processes pinned to a core each: ~1.4 ms on a 256 KB all-reduce that
otherwise takes 2.4 ms; experiments/bench/multiprocess.py measures it). At the lowest priority
(nice 19) the poller still runs whenever the step thread waits for data, and yields to it
otherwise.
"""

import os
import sys
import time

import jax
from absl import logging

POLLER_WAIT = "do_epoll_wait"  # where the idle loop thread sleeps (/proc/.../wchan)
LOWEST_PRIORITY = 19


def _threads() -> dict[int, str]:
    """This process's threads and where each sleeps ("0" while running)."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/wchan") as f:
                found[int(tid)] = f.read()
        except OSError:  # the thread ended meanwhile
            continue
    return found


def start_backend_with_quiet_poller(timeout_sec: float = 1.0) -> int | None:
    """Starts JAX's backend (call it right after `jax.distributed.initialize`, before any other
    JAX call that starts it) and gives gloo's event-loop thread the lowest priority; returns its
    thread id, or None where there is none to find (not Linux, not the CPU backend, the backend
    already started)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self/task"):
        jax.devices()
        return None
    before = set(_threads())
    jax.devices()  # creates the CPU client and gloo's TCP device, which starts its loop thread
    if jax.default_backend() != "cpu":
        return None
    deadline = time.monotonic() + timeout_sec
    while True:
        pollers = [t for t, wait in _threads().items() if t not in before and wait == POLLER_WAIT]
        if len(pollers) == 1:
            os.setpriority(os.PRIO_PROCESS, pollers[0], LOWEST_PRIORITY)
            return pollers[0]
        if len(pollers) > 1 or time.monotonic() > deadline:
            logging.info("gloo's event-loop thread not found (%d candidates)", len(pollers))
            return None
        time.sleep(0.01)  # the new thread has not reached its first wait yet
