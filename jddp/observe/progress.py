"""Training progress on the terminal: a live bar on a TTY, plain lines in logs."""

import datetime
import sys
import time

import tqdm
from absl import logging


class Progress:
    """Shows step, loss, examples/s (tokens/s, MFU when known) and ETA; `update` is called at
    logged steps only, with the record's rates (jddp/observe/throughput.py). `unit` names a
    batch's rows on the line: examples, or rows where each packs several."""

    def __init__(
        self, total_steps: int, *, first_step: int = 0, enabled: bool = True, unit="examples"
    ):
        self.total_steps = total_steps
        self.enabled, self.unit = enabled, unit
        self._last_step = first_step
        self._start = time.perf_counter()
        self._first_step = first_step
        self._bar = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm.tqdm(
                total=total_steps, initial=first_step, unit="step", dynamic_ncols=True
            )

    def update(self, step: int, loss: float, rates: dict[str, float]) -> None:
        if not self.enabled:
            return
        speed = f"{rates['examples_per_sec']:,.0f} {self.unit}/s"
        if "tokens_per_sec" in rates:
            speed += f"  {rates['tokens_per_sec']:,.0f} tokens/s"
        if "mfu" in rates:
            speed += f"  MFU {rates['mfu']:.1%}"
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f}  {speed}")
            self._bar.update(step - self._last_step)
        else:
            elapsed = time.perf_counter() - self._start
            done = step - self._first_step
            eta = elapsed / done * (self.total_steps - step) if done else 0.0
            logging.info(
                "step %d/%d  loss %.4f  %s  ETA %s",
                step,
                self.total_steps,
                loss,
                speed,
                datetime.timedelta(seconds=round(eta)),
            )
        self._last_step = step

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
