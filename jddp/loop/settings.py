"""What `fit` is told besides the trainer, the data and the start: one frozen object per concern
(checkpointing, records, evaluation), gathered in `Settings` with the watchdog's timeout, the
profiler's steps and nan_policy=rollback's policy. Checked when made, before anything is
written."""

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from jddp.core.state import TrainState
from jddp.errors import ConfigError
from jddp.observe.writers import DEFAULT_WRITERS, check_writers
from jddp.runtime.rollback import RollbackPolicy
from jddp.runtime.watchdog import HangBound

Batch = Mapping[str, np.ndarray]
Hook = Callable[[int, TrainState, dict], None]


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """When `fit` saves and what it records: a checkpoint every `every` steps and at the last
    (0: never, and no resume), the newest `max_to_keep` kept; `meta` (JSON-able) saved with
    each; `check(meta, saved_shapes)` may refuse a checkpoint before it is restored."""

    every: int = 500
    max_to_keep: int = 3
    meta: Mapping = dataclasses.field(default_factory=dict)
    check: Callable[[dict, dict], None] | None = None


@dataclasses.dataclass(frozen=True)
class Records:
    """What `fit` writes to metrics.jsonl, TensorBoard and the progress line: a record every
    `every` steps (and at every evaluation and the last step), with the `learning_rate`
    schedule's rate, tokens/s from `tokens_per_example`, MFU against `peak_flops_per_device`
    (0: looked up or measured); `notes` join the first record; `hooks(step, state, record)`
    run after each record is written; `goodput_line`: the goodput summary logged at the end
    (an entry point that prints its own at exit turns it off, so it shows once); `writers`:
    the trackers each record's numbers go to besides metrics.jsonl (names: tensorboard, wandb,
    mlflow; or `jddp.observe.writers.Writer`s), which record `config` (JSON-able) at each
    start; `example_unit`: what the progress line calls a batch's rows ("rows" where each packs
    several documents; `examples_per_sec` counts them)."""

    every: int = 50
    hooks: tuple[Hook, ...] = ()
    learning_rate: Callable[[int], float] | None = None
    tokens_per_example: int = 0
    peak_flops_per_device: float = 0.0
    notes: Mapping = dataclasses.field(default_factory=dict)
    goodput_line: bool = True
    writers: tuple = DEFAULT_WRITERS
    config: Mapping = dataclasses.field(default_factory=dict)
    example_unit: str = "examples"


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What `fit` evaluates: `batches` (a list of batches, or a zero-argument function giving a
    fresh iterable for each pass; None: no evaluation) every `every` steps (0: only at the
    end), with `extras(means)` derived from the means (perplexity)."""

    batches: Iterable[Batch] | Callable[[], Iterable[Batch]] | None = None
    every: int = 0
    extras: Callable[[dict], dict] | None = None

    def pass_fn(self) -> Callable[[], Iterable[Batch]] | None:
        """A zero-argument function giving one pass over the batches, or None; a one-pass
        iterator is a ConfigError (the second evaluation would find it empty)."""
        batches = self.batches
        if batches is None or callable(batches):
            return batches
        if iter(batches) is batches:
            raise ConfigError(
                "eval_batches is a one-pass iterator; pass a list of batches, or a zero-argument "
                "function that returns a fresh iterable for each evaluation"
            )
        return lambda: batches


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything `fit` is told besides the trainer, the data and the start: `num_steps`, one
    object per concern, nan_policy=rollback's `rollback` policy, the watchdog's
    `hang_timeout_s` (None: adaptive to the step time; 0: off; else seconds, or a `HangBound`),
    `profile_steps` ((first step, count) traced into workdir/profile) and `device_prefetch`
    (batches placed ahead of the step). A bad setting is a ConfigError when it is made."""

    num_steps: int
    checkpointing: Checkpointing = Checkpointing()
    records: Records = Records()
    evaluation: Evaluation = Evaluation()
    rollback: RollbackPolicy | None = None
    hang_timeout_s: float | HangBound | None = None
    profile_steps: tuple[int, int] = (0, 0)
    device_prefetch: int = 2

    def __post_init__(self):
        for name, value, least in (
            ("num_steps", self.num_steps, 1),
            ("log_every", self.records.every, 1),
            ("eval_every", self.evaluation.every, 0),
            ("checkpoint_every", self.checkpointing.every, 0),
            ("max_to_keep", self.checkpointing.max_to_keep, 1),
        ):
            if not isinstance(value, int | np.integer) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
        hang = self.hang_timeout_s
        if not isinstance(hang, type(None) | HangBound) and (
            not isinstance(hang, int | float | np.number) or not 0 <= hang < float("inf")
        ):
            raise ConfigError(
                f"hang_timeout_s must be None (adaptive), 0 (off), seconds > 0 or a HangBound, "
                f"got {hang!r}"
            )
        if self.rollback is not None and self.checkpointing.every == 0:
            raise ConfigError("rollback restores checkpoints: pass checkpoint_every > 0")
        self.evaluation.pass_fn()
        check_writers(self.records.writers)
