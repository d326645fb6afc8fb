"""What `fit` calls after each step, each at its own cadence (as Levanter's `TrainerHooks` do,
`every=`): the records (metrics.jsonl, TensorBoard, the progress line, the user's hooks), the
evaluation, the preemption check and the checkpoints. Each has `due(tick)` and acts on the
`Tick`, the step as they all see it."""

import contextlib
import dataclasses
import os
import time

import jax
from absl import logging

from jddp.core.state import TrainState
from jddp.errors import TrainingHalted
from jddp.loop.settings import Checkpointing, Evaluation, Records
from jddp.loop.start import checkpoint_meta
from jddp.observe.metrics_writer import MetricsWriter
from jddp.observe.progress import Progress
from jddp.observe.writers import names_of

SKIPPED = "skipped_batches"  # checkpoint metadata: the [first, last] batches rollbacks skipped


@dataclasses.dataclass
class Tick:
    """One finished step: `state` after it and its device-side `metrics`; whether it is this
    start's first (it compiled) or the run's last; `preempted` once the preemption check has
    run; `record` once a record is opened at this step."""

    step: int
    steps_run: int  # by this start, counting steps a rollback undid: it only grows
    state: TrainState
    metrics: dict
    first: bool
    last: bool
    preempted: bool = False
    record: dict | None = None


def evaluate_metrics(trainer, state, batches, extras=None) -> dict[str, float]:
    """`trainer.evaluate` over `batches`, plus `extras(means)` (such as perplexity)."""
    means = trainer.evaluate(state, batches)
    return means | (extras(means) if extras else {})


def run_config(trainer, num_steps: int, records: Records) -> dict:
    """What the trackers record as the run's config: the run's shape (as its checkpoints
    record it), then the caller's `records.config` (the CLI's: the experiment config)."""
    shape = checkpoint_meta(trainer, num_steps, None)
    shape = {key: value for key, value in shape.items() if key not in ("step", "data")}
    return {"num_steps": num_steps, **shape, **records.config}


def nonfinite_steps(trainer, state, step: int) -> int:
    """The count of non-finite steps so far; unless the trainer skips them, any is the end."""
    count = int(state.nonfinite_steps)
    if count and not trainer.task.skip_nonfinite:
        raise TrainingHalted(
            f"loss or gradients became non-finite by step {step}; stopped without saving it, "
            "the checkpoints already in the workdir are untouched; lower the learning rate, "
            "set grad_clip_norm, or set nan_policy=skip (Trainer(skip_nonfinite=True)) to "
            "drop such updates"
        )
    return count


class RecordKeeper:
    """Every `records.every` steps, at every evaluation and at the last step: a record of the
    step's metrics, rates, learning rate and goodput (`open`, then the evaluation adds to it),
    written to metrics.jsonl and the trackers, shown on the progress line and handed to the
    user's hooks (`write`). Process 0 writes; every process runs the hooks."""

    def __init__(self, trainer, records: Records, num_steps, workdir, start_step, ledger, due_eval):
        self.trainer, self.records, self.ledger, self.due_eval = trainer, records, ledger, due_eval
        self.workdir, self.num_steps, self.start_step = workdir, num_steps, start_step
        self.is_writer = jax.process_index() == 0
        self.writer = None  # opened by `start`
        self.progress = Progress(
            num_steps, first_step=start_step, enabled=self.is_writer, unit=records.example_unit
        )
        self.notes = dict(records.notes)  # join the next record written
        self.throughput = None  # set up at the first step
        self.started = time.perf_counter()
        self.last_step, self.last_time = start_step, self.started

    def start(self) -> None:
        """Opens metrics.jsonl and the trackers (their start is where W&B or MLflow may fail:
        called inside the loop, whose end closes what is open)."""
        self.writer = MetricsWriter(
            self.workdir, start_step=self.start_step, enabled=self.is_writer,
            writers=names_of(self.records.writers),  # checked with the settings
            config=run_config(self.trainer, self.num_steps, self.records),
        )  # fmt: skip
        self.started = self.last_time = time.perf_counter()

    def first_step(self, report: dict, throughput) -> None:
        """The first step's memory report joins the first record; rates from `throughput`."""
        self.notes |= report
        self.throughput = throughput

    def compiled(self) -> None:
        """The first step has finished (compiling): later rates are timed from here."""
        self.last_time = time.perf_counter()

    def rewound(self, step: int, note: dict) -> None:
        """A rollback went back to `step`: records past it are dropped, `note` joins the next."""
        self.writer.rewind(step)
        self.notes |= {"rollback": note}
        self.last_step, self.last_time = step, time.perf_counter()

    def due(self, tick: Tick) -> bool:
        return tick.step % self.records.every == 0 or tick.last or self.due_eval(tick)

    def open(self, tick: Tick) -> None:
        record = {k: float(v) for k, v in jax.device_get(tick.metrics).items()}
        record["nonfinite_steps"] = nonfinite_steps(self.trainer, tick.state, tick.step)
        self.ledger.switch("other")
        if self.records.learning_rate is not None:  # the rate this step applied
            record["learning_rate"] = float(self.records.learning_rate(tick.step - 1))
        # The first step's rates include compiling; later ones are since the last record.
        since = self.started if tick.first else self.last_time
        steps = tick.step - self.last_step
        tick.record = record | self.throughput.rates(steps, time.perf_counter() - since)

    def opened(self, tick: Tick) -> bool:
        return tick.record is not None

    def write(self, tick: Tick) -> None:
        record = tick.record
        record["goodput"] = self.ledger.fraction()  # over every start of the workdir
        if tick.last:
            record["goodput_seconds"] = self.ledger.seconds()
        self.ledger.flush(durable=False)  # at every record: an fsync here is ~10 ms of the step
        self.writer.write(tick.step, record | self.notes)
        self.notes = {}
        self.progress.update(tick.step, record["loss"], record)
        for hook in self.records.hooks:
            hook(tick.step, tick.state, record)
        self.last_step, self.last_time = tick.step, time.perf_counter()

    def close(self) -> None:
        self.progress.close()
        if self.writer is not None:
            self.writer.close()


class Evaluator:
    """Every `evaluation.every` steps and at the last: the eval means (and extras) join the
    step's record; the watchdog bounds each batch by its pause bound, and goodput books it as
    `eval`."""

    def __init__(self, trainer, evaluation: Evaluation, watchdog, ledger):
        self.trainer, self.evaluation, self.watchdog, self.ledger = (
            trainer, evaluation, watchdog, ledger,
        )  # fmt: skip
        self.pass_fn = evaluation.pass_fn()

    def due(self, tick: Tick) -> bool:
        every = self.evaluation.every
        return self.pass_fn is not None and (tick.last or (every > 0 and tick.step % every == 0))

    def __call__(self, tick: Tick) -> None:
        with (
            self.watchdog.paused(f"evaluation at step {tick.step}") as pause,
            self.ledger.timing("eval"),
        ):  # each batch is progress: a long evaluation is no hang, a stuck batch is
            batches = pause.each(self.pass_fn())
            results = evaluate_metrics(self.trainer, tick.state, batches, self.evaluation.extras)
        tick.record |= {f"eval_{k}": v for k, v in results.items() if k != "count"}


class Saver:
    """Every `checkpointing.every` steps, at the last, and when preempted: a checkpoint of the
    state (consolidated: the run goes on from what it saved), with the data's position and
    what `checkpointing.meta` adds. A save that failed to write stops the run at the next
    step. The watchdog bounds it by its pause bound; SIGTERM and Ctrl-C wait for it
    (`PreemptionWatch.saving`); goodput books it as `save`."""

    def __init__(self, trainer, checkpoints, checkpointing: Checkpointing, rollbacks, placed,
                 watchdog, preemption, ledger):  # fmt: skip
        self.trainer, self.checkpoints, self.checkpointing = trainer, checkpoints, checkpointing
        self.rollbacks, self.placed = rollbacks, placed  # the data's position is saved too
        self.watchdog, self.preemption, self.ledger = watchdog, preemption, ledger

    def due(self, tick: Tick) -> bool:
        return self.checkpoints is not None

    def __call__(self, tick: Tick) -> None:
        self.checkpoints.check()
        if self.checkpoints.due(tick.step) or tick.preempted or tick.last:
            with self.ledger.timing("steps"):  # it waits for the step to finish
                nonfinite_steps(self.trainer, tick.state, tick.step)  # never save a NaN state
            with self._guarded(f"checkpoint save of step {tick.step}"):
                tick.state = self.save(tick.state, tick.step)

    @contextlib.contextmanager
    def _guarded(self, what: str):
        """`what` bounded by the watchdog, and not cut short by SIGTERM or Ctrl-C."""
        with self.watchdog.paused(what), self.preemption.saving(what):
            yield

    def save(self, state, step: int) -> TrainState:
        """Saves `state` as step `step`; returns the state to go on from."""
        with self.ledger.timing("save"):
            state = self.trainer.consolidate(state)  # continue from what is saved
            meta = checkpoint_meta(self.trainer, step, self.placed.get_state())
            meta |= dict(self.checkpointing.meta)
            if self.rollbacks is not None:  # a resume skips them too
                meta[SKIPPED] = self.rollbacks.skipped
            self.checkpoints.save(step, self.trainer.global_state(state), meta, force=True)
        self.ledger.checkpoint_saved(step)
        return state

    def wait(self) -> None:
        """Lets a save in flight commit (a started save is a good one)."""
        if self.checkpoints is not None:
            with self._guarded("checkpoint save"), self.ledger.timing("save"):
                self.checkpoints.wait()


class PreemptionCheck:
    """At every step: whether this process (and, with several, every process at the same step)
    was told to stop (SIGTERM, Ctrl-C)."""

    def __init__(self, preemption, ledger):
        self.preemption, self.ledger = preemption, ledger

    def due(self, tick: Tick) -> bool:
        return True

    def __call__(self, tick: Tick) -> None:
        self.ledger.switch("other")  # after an unlogged step: it was only dispatched
        tick.preempted = self.preemption.reached(tick.steps_run)


def log_stop(preemption, checkpoints, step: int, workdir: str) -> None:
    """Says where a preempted or interrupted run saved; an interrupt then raises
    KeyboardInterrupt."""
    saved = "saved a checkpoint" if checkpoints is not None else "saved nothing"
    where = f"at step {step}"
    if preemption.interrupted:
        logging.warning("interrupted: %s %s", saved, where)
        raise KeyboardInterrupt(f"{saved} {where} in {os.path.abspath(workdir)}")
    logging.warning("preempted: %s %s and stopping; run the same command to resume", saved, where)
