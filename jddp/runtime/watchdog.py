"""`HangWatchdog`: a job whose process stops making progress ends, with every thread's stack on
disk and one line on stderr, instead of hanging until someone notices.

A daemon thread watches the outputs of the dispatched steps with `jax.Array.is_ready`, which
never blocks. Progress is a step finishing; also, in a pause (host work that is not a step: an
evaluation pass, a checkpoint save, a rollback's restore) the pause beginning, ending or reporting
progress (each evaluation batch), and a compilation (traced, lowered and compiled by JAX: the
clock waits for it). If the bound passes without progress (`HangBound`: by default adaptive to
the measured step time, never shorter than the first step, which compiles; a pause's bound is
longer), the thread writes every thread's stack to WORKDIR/hang-<process>.txt, logs the last
finished step and what was last dispatched, prints one line and ends the process with
`os._exit(3)`: the main thread is then typically blocked inside a collective in C, where neither
an exception nor a signal handler would run. Nothing is armed before the first step finishes.

Every process has its own watchdog; a process waiting in a collective for a hung peer fires
too: both count from the same last finished step, and a process that fires waits a grace period
(two polls and a second) before it exits, because a peer's collective fails at once when it does,
before the peer's own watchdog would have written its stacks. A process whose watchdog thread
cannot run at all (SIGSTOP) is ended by `jddp-launch`, which the thread's heartbeat tells how long
to wait (jddp/runtime/heartbeat.py).
"""

import collections
import contextlib
import dataclasses
import faulthandler
import os
import statistics
import sys
import threading
import time

import jax
from absl import logging

from jddp.runtime.heartbeat import Beat

EXIT_CODE = 3
_STEP_SAMPLES = 64  # recent per-step times the adaptive bound takes the median of
_COMPILE_EVENTS = (  # JAX's monitoring events around tracing, lowering and compiling
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


@dataclasses.dataclass(frozen=True)
class HangBound:
    """How long a process may go without progress: `fixed_s` for training steps when given,
    else adaptive: `step_multiple` times the median recent step, never below `floor_s` (PyTorch's
    NCCL watchdog default, 10 minutes) nor `compile_multiple` times the first step (it compiles).
    A pause (evaluation, save, compilation) may last `pause_multiple` times the step bound, at
    least `pause_floor_s`."""

    fixed_s: float | None = None
    floor_s: float = 600.0
    step_multiple: float = 20.0
    compile_multiple: float = 2.0
    pause_floor_s: float = 1800.0
    pause_multiple: float = 3.0

    @classmethod
    def from_setting(cls, hang_timeout_s) -> "HangBound | None":
        """`hang_timeout_s`: None adaptive, 0 off (None returned), a HangBound itself, else a
        fixed step bound in seconds."""
        if isinstance(hang_timeout_s, HangBound):
            return hang_timeout_s
        if hang_timeout_s is None:
            return cls()
        return cls(fixed_s=float(hang_timeout_s)) if hang_timeout_s > 0 else None

    def for_steps(self, step_times, first_step_s: float) -> float:
        """The step bound, given recent per-step times (seconds) and the first step's time."""
        if self.fixed_s is not None:
            return self.fixed_s
        median = statistics.median(step_times) if step_times else 0.0
        return max(self.floor_s, self.step_multiple * median, self.compile_multiple * first_step_s)

    def for_pause(self, step_bound: float) -> float:
        return max(self.pause_floor_s, self.pause_multiple * step_bound)

    def describe(self, step_bound: float) -> str:
        """The setting as the hang line says it: `hang_timeout_s=600` or `...=auto: 612 s`."""
        if self.fixed_s is not None:
            return f"hang_timeout_s={self.fixed_s:g}"
        return f"hang_timeout_s=auto: {step_bound:.0f} s"


class HangWatchdog:
    """Ends the process when it makes no progress within `bound` (a `HangBound`), once the first
    step has finished."""

    def __init__(
        self, bound: HangBound, workdir: str, process_index: int | None = None, on_hang=None
    ):
        self.bound = bound
        index = jax.process_index() if process_index is None else process_index
        self.path = os.path.join(os.path.abspath(workdir), f"hang-{index}.txt")
        self._on_hang = on_hang or os._exit  # tests pass their own, given the exit code
        self._lock = threading.Lock()
        self._pending = collections.deque()  # (step, an output of that step), oldest first
        self._finished_step = None
        self._started = time.monotonic()
        self._first_step_s = 0.0
        self._step_times = collections.deque(maxlen=_STEP_SAMPLES)
        self._since = None  # when progress was last made; None: unarmed (no step finished)
        self._pauses = []  # what the main thread is doing besides steps, innermost last
        self._compiling = 0
        self._last_dispatched = "nothing"
        self._beat = Beat.from_env()
        self._stop = threading.Event()
        jax.monitoring.register_scalar_listener(self._compile_started)
        jax.monitoring.register_event_duration_secs_listener(self._compile_ended)
        self._thread = threading.Thread(target=self._watch, name="jddp-hang-watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, hang_timeout_s, workdir: str):
        """A running watchdog (`hang_timeout_s` None: adaptive; seconds: a fixed bound; or a
        `HangBound`), or one that does nothing when it is 0."""
        bound = HangBound.from_setting(hang_timeout_s)
        return cls(bound, workdir) if bound is not None else _Off()

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
        """The main thread does `what`, bounded by the pause bound; the `Pause` it yields
        restarts the clock on `progress()` (an evaluation batch)."""
        with self._lock:
            self._pauses.append(what)
            self._last_dispatched = what
            self._progressed()
        try:
            yield _Pause(self)
        finally:
            with self._lock:
                self._pauses.remove(what)
                self._progressed()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        jax.monitoring.unregister_scalar_listener(self._compile_started)
        jax.monitoring.unregister_event_duration_listener(self._compile_ended)
        if self._beat is not None:
            self._beat.close()

    # ----------------------------------------------------------------- on JAX's and our threads
    def _compile_started(self, event: str, _value, **_) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                self._compiling += 1
                self._progressed()

    def _compile_ended(self, event: str, _duration, **_) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                self._compiling = max(0, self._compiling - 1)  # one begun before we listened
                self._progressed()

    def _progressed(self) -> None:
        """(Under the lock.) The clock restarts, once armed."""
        if self._since is not None:
            self._since = time.monotonic()

    def _watch(self) -> None:
        poll = min(1.0, max(0.05, (self.bound.fixed_s or self.bound.floor_s) / 10))
        self._grace = 2 * poll + 1 if jax.process_count() > 1 else 0.0
        while True:
            with self._lock:
                now, finished = time.monotonic(), 0
                while self._pending and self._pending[0][1].is_ready():
                    self._finished_step = self._pending.popleft()[0]
                    finished += 1
                if finished:
                    if self._since is None:  # the first step: it compiled
                        self._first_step_s = now - self._started
                    elif not self._pauses and not self._compiling:
                        self._step_times.append((now - self._since) / finished)
                    self._since = now
                step_bound = self.bound.for_steps(self._step_times, self._first_step_s)
                pausing = self._pauses[-1] if self._pauses else None
                if self._compiling and not pausing:
                    pausing = "compiling"
                idle = now - self._since if self._since is not None else 0.0
            limit = self.bound.for_pause(step_bound) if pausing else step_bound
            if idle > limit:
                self._fire(idle, limit, pausing, step_bound)
                return
            if self._beat is not None:
                self._beat.beat(limit)  # a pause is allowed its own, longer, bound
            if self._stop.wait(poll):
                return

    def _fire(self, idle: float, limit: float, pausing: str | None, step_bound: float) -> None:
        with self._lock:
            step, last = self._finished_step, self._last_dispatched
        if pausing:
            where = f"{pausing} made no progress for {idle:.0f} s after step {step}"
            setting = f"bound {limit:.0f} s for evaluations, saves and compiles"
        else:
            where = f"no training step finished for {idle:.0f} s after step {step}"
            setting = self.bound.describe(step_bound)
        try:
            with open(self.path, "w") as f:
                f.write(f"{where} ({setting}); last dispatched: {last}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            stacks = f"every thread's stack is in {self.path}"
        except OSError as e:
            stacks = f"could not write the stacks to {self.path} ({e.strerror})"
        logging.error("hang: %s; last dispatched: %s; %s", where, last, stacks)
        print(
            f"error: {where} ({setting}); last dispatched: {last}; {stacks}",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(self._grace)
        self._on_hang(EXIT_CODE)


class _Pause:
    def __init__(self, watchdog: HangWatchdog):
        self._watchdog = watchdog

    def progress(self) -> None:
        with self._watchdog._lock:
            self._watchdog._progressed()

    def each(self, items):
        """`items`, the clock restarting at each."""
        for item in items:
            self.progress()
            yield item


class _Off:
    """The watchdog of `hang_timeout_s=0`: every call does nothing."""

    def dispatching(self, step) -> None:
        pass

    def dispatched(self, step, output) -> None:
        pass

    @contextlib.contextmanager
    def paused(self, what):
        yield _NoPause()

    def close(self) -> None:
        pass


class _NoPause:
    def progress(self) -> None:
        pass

    def each(self, items):
        return items
