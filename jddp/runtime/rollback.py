"""`nan_policy=rollback`: on a non-finite loss (or gradient), or a loss above `spike_factor` x
the median of the recent losses, the loop restores the newest checkpoint and skips the batches
trained on since it, the bad one included (as PaLM's authors did by hand for loss spikes). Every
process sees the same global loss, so every process takes the same decision at the same step.
The skipped batches are written to the metrics and to every later checkpoint; after
`max_in_a_row` rollbacks to the same checkpoint the run stops with one line.
"""

import collections
import dataclasses
import math

import numpy as np

from jddp.errors import ConfigError, TrainingHalted


@dataclasses.dataclass(frozen=True)
class RollbackPolicy:
    """When `jddp.fit` rolls back (pass it as `fit(..., rollback=RollbackPolicy())`).

    spike_factor: also roll back when a loss exceeds this many times the median of the last
        `window` losses (0: only non-finite losses and gradients).
    window: how many recent losses the median is taken over; no spike is called before the
        window is full.
    max_in_a_row: stop after this many rollbacks to the same checkpoint.
    """

    spike_factor: float = 0.0
    window: int = 32
    max_in_a_row: int = 3

    def __post_init__(self):
        if not (self.spike_factor == 0 or self.spike_factor > 1):
            raise ConfigError(
                f"spike_factor must be 0 (off) or above 1, got {self.spike_factor!r}; a loss "
                "this many times its recent median counts as a spike"
            )
        for name in ("window", "max_in_a_row"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")


class Rollbacks:
    """The rollback decisions of one run: `bad(step, loss, nonfinite)` says whether step `step`
    must be undone, and why; `rolled_back(...)` records one and returns its metrics note."""

    def __init__(self, policy: RollbackPolicy, skipped: list | None = None):
        self.policy = policy
        self.skipped = [list(span) for span in skipped or []]  # [first, last] batches skipped
        self._losses = collections.deque(maxlen=policy.window)
        self._in_a_row, self._last_target = 0, None

    @property
    def skipped_batches(self) -> int:
        return sum(last - first + 1 for first, last in self.skipped)

    def bad(self, loss: float, nonfinite: bool) -> str | None:
        """Why the step with this (global) loss must be undone, or None (its loss is kept)."""
        if nonfinite or not math.isfinite(loss):
            return "non-finite loss or gradients"
        losses, factor = self._losses, self.policy.spike_factor
        if factor and len(losses) == losses.maxlen:
            median = float(np.median(losses))
            if loss > factor * median:
                return f"loss spike ({loss:.4g} > {factor:g} x recent median {median:.4g})"
        losses.append(loss)
        return None

    def rolled_back(self, bad_step: int, to_step: int, reason: str) -> dict:
        """Records a rollback from `bad_step` to the checkpoint at `to_step`: the batches of
        steps to_step+1 .. bad_step are skipped. Raises TrainingHalted after max_in_a_row
        rollbacks to the same checkpoint."""
        self._in_a_row = self._in_a_row + 1 if to_step == self._last_target else 1
        self._last_target = to_step
        if self._in_a_row > self.policy.max_in_a_row:
            raise TrainingHalted(
                f"{reason} at step {bad_step} after {self.policy.max_in_a_row} rollbacks in a "
                f"row to the checkpoint at step {to_step}; stopped, the checkpoints are "
                "untouched; lower the learning rate, set grad_clip_norm, or check the data "
                "after that step"
            )
        # Batches are numbered by the data position: step + the batches skipped before.
        first = to_step + 1 + self.skipped_batches
        last = bad_step + self.skipped_batches
        self.skipped.append([first, last])
        self._losses.clear()  # the losses since the checkpoint are undone with their steps
        return {
            "from_step": bad_step,
            "to_step": to_step,
            "reason": reason,
            "skipped_batches": [first, last],
            "in_a_row": self._in_a_row,
        }
