"""One start of a job's processes on this machine, for `jddp-launch`: start them, relay their
output, notice the first that fails, stop the rest, and say what happened.

Output lines are held back `HOLD_S` before they are printed (with the rank in front): when a
process dies, the others' last words (a collective's "connection reset by peer" traceback, an
abort's stack dump) follow within milliseconds, and are dropped rather than printed, so that
what the user reads last is the launcher's one line about the process that failed. The failed
process's own output is printed in full.
"""

import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from jddp.runtime import heartbeat, orphans

HOLD_S = 0.5  # a line is printed this long after it was read, unless its process was muted
SETTLE_S = 0.5  # after a failure, how long the others may take to end on their own
HANG_SETTLE_S = 15.0  # ... after a hang: every process's watchdog reports, within seconds
STOP_GRACE_S = 30.0  # while stopping: after one process failed, before the rest are killed
HANG_EXIT_CODE = 3  # jddp/runtime/watchdog.py
# Signals passed on to every process. SIGHUP (a closed terminal or ssh session) as SIGTERM:
# the processes save a checkpoint and stop, as on preemption.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FORWARDED_AS = {signal.SIGHUP: signal.SIGTERM}
# What ends a process from outside (a user, the kernel's OOM killer, a scheduler), never a lost
# peer: a survivor aborts or exits with an error.
FROM_OUTSIDE = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclasses.dataclass
class Outcome:
    """How a start ended: each rank's exit code (negative: killed by that signal), the rank
    that failed first (None: none failed), each rank's last `error:` line, and whether the
    launcher itself asked the processes to stop (`stop`)."""

    codes: dict[int, int]
    failed: int | None
    errors: dict[int, str]
    stopped: bool
    silent: heartbeat.Silence | None = None  # the failed process, when its heartbeat stopped


class _Output:
    """The relay of every process's output lines, each printed HOLD_S after it was read."""

    def __init__(self):
        self._lines = queue.Queue()
        self._held = []  # (time read, rank, text), oldest first
        self._only, self._since = None, float("inf")  # after a failure: see mute_all_but
        self._lock = threading.Lock()
        self.errors = {}
        self._done = threading.Event()
        self._printer = threading.Thread(target=self._print_loop, daemon=True)
        self._printer.start()

    def read(self, rank: int, stream) -> threading.Thread:
        def relay():
            for text in iter(stream.readline, ""):
                if text.startswith("error: "):
                    with self._lock:
                        self.errors[rank] = text.rstrip("\n")
                self._lines.put((time.monotonic(), rank, text))

        thread = threading.Thread(target=relay, daemon=True)
        thread.start()
        return thread

    def mute_all_but(self, rank: int, since: float) -> None:
        """Drops the other ranks' lines read from `since` on (the failure's consequences)."""
        with self._lock:
            self._only, self._since = rank, since

    def _print_loop(self) -> None:
        while not self._done.is_set():
            self._print(until=time.monotonic() - HOLD_S)
            self._done.wait(0.05)

    def _print(self, until: float) -> None:
        while True:
            try:
                self._held.append(self._lines.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            due = [line for line in self._held if line[0] <= until]
            self._held = self._held[len(due) :]
            lines = [
                f"[{rank}] {text}"
                for read, rank, text in due
                if read < self._since or rank == self._only
            ]
        if lines:
            sys.stdout.writelines(lines)
            sys.stdout.flush()

    def close(self, relays) -> None:
        """Prints what is left, once every relay has read its process's last line."""
        for relay in relays:
            relay.join()
        self._done.set()
        self._printer.join()
        self._print(until=float("inf"))


def run_processes(
    command: list[str],
    nproc: int,
    env_for: Callable[[int], dict],
    stop_when: Callable[[], bool] = lambda: False,
    on_signal: Callable[[], None] = lambda: None,
) -> Outcome:
    """Runs `command` as `nproc` processes (rank r with the environment `env_for(r)`) until all
    end. The first that fails stops the others (SIGKILL, once they had SETTLE_S to end by
    themselves). `stop_when()`, asked about once a second, asks them to stop (SIGTERM: they save
    a checkpoint at a step they agree on, and end). SIGINT and SIGTERM reach every process (and
    SIGHUP, as SIGTERM), and `on_signal()` is called. Each process is killed if this one dies. A
    process whose watchdog's heartbeat (jddp/runtime/heartbeat.py) stops for its bound counts as
    failed (`Outcome.silent`)."""
    output, children, relays, exits = _Output(), [], [], queue.Queue()
    stopping = threading.Event()
    # A process whose watchdog cannot run (stopped, frozen) is ended from here: each child is
    # told where its watchdog's heartbeat goes.
    heartbeats, own_env_for = heartbeat.Watch(), env_for

    def env_for(rank: int) -> dict:
        return heartbeats.env(rank, own_env_for(rank))

    def forward(signum, _frame):
        stopping.set()
        on_signal()
        for child in children:
            if child.poll() is None:
                child.send_signal(FORWARDED_AS.get(signum, signum))

    # Installed before the first child starts: a signal during start-up reaches the children
    # started so far (they run in their own sessions, so nothing else would stop them).
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        for rank in range(nproc):
            try:
                child = subprocess.Popen(
                    command,
                    env=env_for(rank),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,  # the terminal's signals come through `forward`
                    preexec_fn=orphans.die_with_parent(),  # from this thread: the main one
                )
            except OSError:
                _kill(children)
                raise
            children.append(child)
            relays.append(output.read(rank, child.stdout))
            threading.Thread(
                target=lambda r=rank, c=child: exits.put((r, c.wait(), time.monotonic())),
                daemon=True,
            ).start()
        failed, failed_at, silent = _wait(children, exits, stopping, stop_when, heartbeats)
        if failed is not None:
            # A survivor may notice the loss (a reset connection) before the waiter thread gets
            # to run on a busy machine: its lines still held back are dropped too.
            output.mute_all_but(failed, since=failed_at - HOLD_S)
            settle = HANG_SETTLE_S if children[failed].returncode == HANG_EXIT_CODE else SETTLE_S
            _wait_all(children, settle)
            _kill(children)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        heartbeats.close()
    output.close(relays)
    return Outcome(
        codes={rank: child.wait() for rank, child in enumerate(children)},
        failed=failed,
        errors=dict(output.errors),
        stopped=stopping.is_set(),
        silent=silent,
    )


def _wait(children, exits, stopping, stop_when, heartbeats) -> tuple[int | None, float, object]:
    """Waits until every child ended ((None, 0, None)) or one failed ((its rank, when it ended,
    None)) or fell silent ((its rank, now, its `heartbeat.Silence`)). While they stop (asked
    to), one that fails leaves the others STOP_GRACE_S to end: they may wait for it in a
    collective."""
    ended, next_ask, kill_at = 0, time.monotonic() + 1.0, float("inf")
    while ended < len(children):
        try:
            rank, code, when = exits.get(timeout=0.1)
        except queue.Empty:
            if time.monotonic() >= kill_at:
                _kill(children)
            silent = heartbeats.silent(_running(children))
            if silent is not None:
                return silent.rank, time.monotonic(), silent
            if time.monotonic() >= next_ask:
                next_ask = time.monotonic() + 1.0
                if not stopping.is_set() and stop_when():
                    stopping.set()
                    for child in children:
                        if child.poll() is None:
                            child.terminate()
            continue
        ended += 1
        if code != 0 and not stopping.is_set():
            # A peer of a stopped process fails first (JAX's own heartbeat declares it lost):
            # the stopped one is the cause.
            behind = heartbeat.stopped(_running(children))
            if behind is not None:
                return behind.rank, when, behind
            return _cause(children, rank, code), when, None
        if code != 0:
            kill_at = min(kill_at, time.monotonic() + STOP_GRACE_S)
    return None, 0.0, None


def _cause(children, rank: int, code: int) -> int:
    """The rank to name for a failure read from `rank` (exit `code`): itself, unless a peer has
    already been ended from outside. A survivor aborts within milliseconds of losing its peer,
    and on a busy machine the waiter threads may read its exit first."""
    if -code in FROM_OUTSIDE:
        return rank
    for other, child in enumerate(children):
        code = child.poll()
        if code is not None and -code in FROM_OUTSIDE:
            return other
    return rank


def _running(children) -> dict[int, int]:
    return {rank: child.pid for rank, child in enumerate(children) if child.poll() is None}


def _wait_all(children, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _kill(children) -> None:
    """SIGKILL to each child's whole session: a survivor of a lost peer cannot save (a save
    needs every process) and may be stuck in a collective."""
    for child in children:
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        child.wait()
