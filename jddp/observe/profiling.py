"""A `jax.profiler` trace of chosen training steps, for TensorBoard's profile plugin or Perfetto.

The trace lands in `LOGDIR/plugins/profile/RUN/`: `*.xplane.pb` (TensorBoard:
`tensorboard --logdir LOGDIR`, Profile tab) and `perfetto_trace.json.gz` (open it in
https://ui.perfetto.dev).
"""

import contextlib

import jax
from absl import logging


class StepProfiler:
    """Traces steps `start_step` .. `start_step + num_steps - 1` (1-based, as logged); off when
    `start_step` is 0. Each traced step is annotated, so TensorBoard shows per-step times."""

    def __init__(self, logdir: str, start_step: int, num_steps: int):
        self.logdir = logdir
        self.first = start_step
        self.last = start_step + max(num_steps, 1) - 1
        self._active = False

    def step(self, step: int) -> contextlib.AbstractContextManager:
        """Wrap step `step`'s dispatch: starts the trace at the first chosen step and annotates."""
        if not self.first or not self.first <= step <= self.last:
            return contextlib.nullcontext()
        if step == self.first:
            jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
            self._active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, output) -> None:
        """Call after step `step` with one of its outputs: stops the trace after the last chosen
        step, once that step has finished on the device."""
        if self._active and step >= self.last:
            self.stop(output)

    def stop(self, output=None) -> None:
        if not self._active:
            return
        if output is not None:
            jax.block_until_ready(output)
        jax.profiler.stop_trace()
        self._active = False
        logging.info("profiler trace of steps %d-%d in %s", self.first, self.last, self.logdir)
