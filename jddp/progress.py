"""Training progress on the terminal: a live bar on a TTY, plain lines in logs."""

import datetime
import sys
import time

import tqdm
from absl import logging


class Progress:
    """Shows step, loss, examples/s and ETA; `update` is called at logged steps only."""

    def __init__(self, total_steps: int, *, first_step: int = 0, enabled: bool = True):
        self.total_steps = total_steps
        self.enabled = enabled
        self._last_step = first_step
        self._start = time.perf_counter()
        self._first_step = first_step
        self._bar = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm.tqdm(
                total=total_steps, initial=first_step, unit="step", dynamic_ncols=True
            )

    def update(self, step: int, loss: float, examples_per_sec: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", examples_per_s=f"{examples_per_sec:,.0f}")
            self._bar.update(step - self._last_step)
        else:
            elapsed = time.perf_counter() - self._start
            done = step - self._first_step
            eta = elapsed / done * (self.total_steps - step) if done else 0.0
            logging.info(
                "step %d/%d  loss %.4f  %.0f examples/s  ETA %s",
                step,
                self.total_steps,
                loss,
                examples_per_sec,
                datetime.timedelta(seconds=round(eta)),
            )
        self._last_step = step

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
