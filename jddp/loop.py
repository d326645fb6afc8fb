"""`fit`: the training loop of the library and of the CLI; `save` / `restore` for your own loop.

    state = jddp.fit(trainer, batches, workdir="runs/a", num_steps=1000, eval_batches=eval_set)

`fit` owns its workdir: `metrics.jsonl` and TensorBoard files, the progress line, evaluation,
checkpoints with exact resume (the same call again continues bit for bit), a save on SIGTERM and
on Ctrl-C, the hang watchdog, the throughput / MFU / memory report, where the wall time went
(goodput, over every start of the workdir), and a lock that keeps a second run out. See
docs/loop.md.
"""

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping

import jax
import numpy as np
from absl import logging

from jddp.checkpoints import store
from jddp.checkpoints.store import Checkpoints
from jddp.core.state import TrainState
from jddp.data.prefetch import prefetch_to_device
from jddp.errors import ConfigError, DataError, TrainingHalted
from jddp.observe import device_peak, flops, goodput
from jddp.observe.memory import format_bytes
from jddp.observe.metrics_writer import MetricsWriter
from jddp.observe.profiling import StepProfiler
from jddp.observe.progress import Progress
from jddp.observe.throughput import Throughput
from jddp.runtime import processes
from jddp.runtime.preemption import PreemptionWatch
from jddp.runtime.rollback import RollbackPolicy, Rollbacks
from jddp.runtime.watchdog import HangWatchdog
from jddp.runtime.workdir import check_workdir, hold_workdir
from jddp.trainer import Trainer
from jddp.version import __version__

Batch = Mapping[str, np.ndarray]
SKIPPED = "skipped_batches"  # checkpoint metadata: the [first, last] batches rollbacks skipped
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
    (an entry point that prints its own at exit turns it off, so it shows once)."""

    every: int = 50
    hooks: tuple[Hook, ...] = ()
    learning_rate: Callable[[int], float] | None = None
    tokens_per_example: int = 0
    peak_flops_per_device: float = 0.0
    notes: Mapping = dataclasses.field(default_factory=dict)
    goodput_line: bool = True


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What `fit` evaluates: `batches` (a list of batches, or a zero-argument function giving a
    fresh iterable for each pass; None: no evaluation) every `every` steps (0: only at the
    end), with `extras(means)` derived from the means (perplexity)."""

    batches: Iterable[Batch] | Callable[[], Iterable[Batch]] | None = None
    every: int = 0
    extras: Callable[[dict], dict] | None = None

    def pass_fn(self) -> Callable[[], Iterable[Batch]] | None:
        """A zero-argument function giving one pass over the batches, or None."""
        return _eval_pass(self.batches)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything `fit` is told besides the trainer, the data and the start: one object per
    concern (the watchdog's `hang_timeout_s`: 0 is off; `profile_steps`: (first step, count)
    traced into workdir/profile; `device_prefetch`: batches placed ahead of the step). Checked
    when made: a bad setting is a ConfigError before anything is written."""

    num_steps: int
    checkpointing: Checkpointing = Checkpointing()
    records: Records = Records()
    evaluation: Evaluation = Evaluation()
    rollback: RollbackPolicy | None = None
    hang_timeout_s: float = 0.0
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
        if self.rollback is not None and self.checkpointing.every == 0:
            raise ConfigError("rollback restores checkpoints: pass checkpoint_every > 0")
        self.evaluation.pass_fn()  # a one-pass iterator is refused now


def fit(
    trainer,
    train_batches: Iterable[Batch],
    *,
    workdir: str,
    num_steps: int,
    sample_batch: Batch | None = None,
    seed: int = 0,
    state: TrainState | Callable[[], TrainState] | None = None,
    eval_batches: Iterable[Batch] | Callable[[], Iterable[Batch]] | None = None,
    eval_every: int = 0,
    log_every: int = 50,
    checkpoint_every: int = 500,
    max_to_keep: int = 3,
    hang_timeout_s: float = 0.0,
    hooks: Iterable[Hook] = (),
    learning_rate: Callable[[int], float] | None = None,
    eval_extras: Callable[[dict], dict] | None = None,
    tokens_per_example: int = 0,
    peak_flops_per_device: float = 0.0,
    device_prefetch: int = 2,
    profile_steps: tuple[int, int] = (0, 0),
    checkpoint_meta: Mapping | None = None,
    check_checkpoint: Callable[[dict, dict], None] | None = None,
    notes: Mapping | None = None,
    rollback: RollbackPolicy | None = None,
    started_at: float | None = None,
) -> TrainState:
    """Trains `trainer` on `train_batches` up to step `num_steps` in `workdir`; returns the
    final state (on SIGTERM: the state it saved, whose `step` is below `num_steps`).

    A rerun of the same call resumes from the newest checkpoint in `workdir`, skipping the
    batches already trained on (through `get_state()` / `set_state()` when the iterator has them,
    as grain's do). Ctrl-C saves at the end of the step and raises KeyboardInterrupt. Every
    argument is described in docs/loop.md; the keywords fill `Settings`' objects (`train` takes
    them whole).
    """
    ledger = _ledger(workdir, started_at)
    settings = Settings(
        num_steps,
        Checkpointing(checkpoint_every, max_to_keep, dict(checkpoint_meta or {}), check_checkpoint),
        Records(
            log_every,
            tuple(hooks),
            learning_rate,
            tokens_per_example,
            peak_flops_per_device,
            dict(notes or {}),
        ),  # fmt: skip
        Evaluation(eval_batches, eval_every, eval_extras),
        rollback,
        hang_timeout_s,
        profile_steps,
        device_prefetch,
    )
    store.check_checkpoints_dir(
        os.path.join(workdir, "checkpoints"), checkpointing=checkpoint_every > 0
    )
    check_workdir(workdir, resumable=checkpoint_every > 0, name="workdir")
    # An iterator is used as it is (one with `__next__` but no `__iter__` too), else iterated.
    batches = train_batches if hasattr(train_batches, "__next__") else iter(train_batches)
    check_train_batches(batches)
    if sample_batch is None:
        peeked = _peek(batches)
        if peeked is None:
            raise DataError("train_batches is empty; pass an iterable of batches (dicts of arrays)")
        sample_batch, put_back = peeked
        if not put_back:  # no get_state: the peeked batch goes back in front
            batches = itertools.chain([sample_batch], batches)
    trainer.check_layout(sample_batch)
    processes.barrier("fit: checks done")
    with hold_workdir(workdir):
        return train(
            trainer, batches, workdir, settings, sample_batch, seed=seed, state=state,
            ledger=ledger,
        )  # fmt: skip


def _ledger(workdir: str, started_at: float | None) -> goodput.Ledger:
    """Where the time goes (jddp/observe/goodput.py), kept by process 0 in workdir/goodput.json."""
    return goodput.Ledger(workdir if jax.process_index() == 0 else None, started_at=started_at)


def train(
    trainer,
    batches,
    workdir: str,
    settings: Settings,
    sample_batch: Batch,
    *,
    seed: int = 0,
    state: TrainState | Callable[[], TrainState] | None = None,
    ledger: goodput.Ledger | None = None,
    started_at: float | None = None,
) -> TrainState:
    """`fit`'s loop in a `workdir` its caller has checked and holds (`hold_workdir`), on a
    `batches` iterator already checked (`check_train_batches`) that `sample_batch` shapes:
    resumes the newest checkpoint, or starts from `state` (a state or a function giving one)
    or `seed`; the goodput `ledger` started at `started_at` unless given."""
    start_time = time.perf_counter()
    ledger = ledger or _ledger(workdir, started_at)
    checkpointing = settings.checkpointing
    checkpoints = None
    if checkpointing.every > 0:
        checkpoints = Checkpoints(
            os.path.join(workdir, "checkpoints"),
            every=checkpointing.every,
            max_to_keep=checkpointing.max_to_keep,
        )
    try:
        start_step, state, saved = _restore_or_start(
            trainer, checkpoints, sample_batch, seed, state, checkpointing.check, ledger
        )
        rollbacks = Rollbacks(settings.rollback, saved.get(SKIPPED)) if settings.rollback else None
        if start_step > settings.num_steps:
            raise ConfigError(
                f"the checkpoints in {checkpoints.directory} reach step {start_step}, past "
                f"num_steps={settings.num_steps}; raise num_steps or pass another workdir"
            )
        skipped = rollbacks.skipped_batches if rollbacks else 0
        _position(batches, start_step + skipped, saved.get("data"))
    except BaseException:
        if checkpoints is not None:
            checkpoints.close()
        raise
    if start_step:
        logging.info("resuming from the checkpoint at step %d in %s", start_step, workdir)
    if start_step == settings.num_steps:  # nothing to train: nothing is written either
        if checkpoints is not None:
            checkpoints.close()
        return state
    processes.check_same_everywhere(
        "config, seed and initial parameters",
        [json.dumps(dict(checkpointing.meta), sort_keys=True, default=str), _checksum(state)],
    )
    rows = []  # of the first batch: the global batch size follows

    def place(batch):
        if not rows:
            rows.append(_rows(batch))
        return trainer.place_batch(batch)

    placed = prefetch_to_device(batches, place, settings.device_prefetch)
    ledger.begin(start_step)
    loop = _Loop(
        trainer=trainer,
        workdir=workdir,
        settings=settings,
        start_step=start_step,
        start_time=start_time,
        checkpoints=checkpoints,
        rows=rows,
        sample_batch=sample_batch,
        rollbacks=rollbacks,
        ledger=ledger,
    )
    return loop.run(state, placed)


@dataclasses.dataclass
class _Loop:
    """The steps of one `fit` call, with what watches and records them as `settings` say."""

    trainer: Trainer
    workdir: str
    settings: Settings
    start_step: int
    start_time: float
    checkpoints: Checkpoints | None
    rows: list[int]  # the first batch's rows, once it is placed: the global batch size follows
    sample_batch: Batch
    rollbacks: Rollbacks | None  # nan_policy=rollback's decisions, or None
    ledger: goodput.Ledger  # the stopwatch: every second of the start is in one category
    throughput: Throughput | None = None  # set up at the first step

    def run(self, state: TrainState, placed) -> TrainState:
        settings = self.settings
        records, evaluation = settings.records, settings.evaluation
        trainer, start_step, num_steps = self.trainer, self.start_step, settings.num_steps
        checkpoints, record_extra = self.checkpoints, dict(records.notes)
        ledger, is_writer, eval_pass = self.ledger, jax.process_index() == 0, evaluation.pass_fn()
        ledger.switch("other")  # the loop begins: its own work, unless a category says more
        ledger.flush()
        writer = MetricsWriter(self.workdir, start_step=start_step, enabled=is_writer)
        progress = Progress(num_steps, first_step=start_step, enabled=is_writer)
        preemption = PreemptionWatch()
        profiler = StepProfiler(os.path.join(self.workdir, "profile"), *settings.profile_steps)
        watchdog = HangWatchdog.start(settings.hang_timeout_s, self.workdir)
        stopped_at, step, steps_run = None, start_step, 0
        last_log_step, last_log_time = start_step, time.perf_counter()
        try:
            if self.rollbacks and not checkpoints.steps():  # a checkpoint to go back to
                with ledger.timing("save"):
                    state = self._save(state, 0, placed.get_state())
                ledger.checkpoint_saved(0)
            while step < num_steps:
                step, steps_run = step + 1, steps_run + 1
                with ledger.timing("data"):
                    batch = next(placed, None)
                if batch is None:
                    raise DataError(
                        f"train_batches ran out before step {step}; num_steps={num_steps} "
                        "needs one batch per step: repeat the data, or lower num_steps"
                    )
                # The step, up to what waits for its results: this start's first one compiles
                # (counted in steps run: a rollback may bring `step` back to the start's).
                first = steps_run == 1
                ledger.switch("compile" if first else "steps")
                if first:
                    record_extra |= self._first_step_report(state, batch)
                watchdog.dispatching(step)  # a dispatch may wait in a collective itself
                with profiler.step(step):
                    state, metrics = trainer.step(state, batch)
                watchdog.dispatched(step, metrics["loss"])
                profiler.after(step, metrics["loss"])
                if first:  # compilation: time the steady state from here
                    metrics["loss"].block_until_ready()
                    last_log_time = time.perf_counter()
                if self.rollbacks is not None:
                    undone = self._roll_back_if_bad(state, metrics, step, watchdog)
                    if undone is not None:
                        ledger.step_done(step)
                        state, step, note = undone
                        ledger.rewind(step)  # the steps since the checkpoint were lost
                        ledger.switch("other")
                        writer.rewind(step)
                        record_extra |= {"rollback": note}
                        last_log_step, last_log_time = step, time.perf_counter()
                        continue
                ledger.step_done(step)
                is_last = step == num_steps
                evaluate = eval_pass is not None and (
                    is_last or (evaluation.every > 0 and step % evaluation.every == 0)
                )
                if step % records.every == 0 or evaluate or is_last:
                    record = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    record["nonfinite_steps"] = self._nonfinite_steps(state, step)
                    ledger.switch("other")
                    if records.learning_rate is not None:  # the rate this step applied
                        record["learning_rate"] = float(records.learning_rate(step - 1))
                    # The first step's rates include compiling; later ones are since the last.
                    since = self.start_time if first else last_log_time
                    record |= self.throughput.rates(
                        step - last_log_step, time.perf_counter() - since
                    )
                    if evaluate:
                        with watchdog.paused(f"evaluation at step {step}"), ledger.timing("eval"):
                            results = evaluate_metrics(
                                trainer, state, eval_pass(), evaluation.extras
                            )
                        record |= {f"eval_{k}": v for k, v in results.items() if k != "count"}
                    record["goodput"] = ledger.fraction()  # over every start of the workdir
                    if is_last:
                        record["goodput_seconds"] = ledger.seconds()
                    ledger.flush()
                    writer.write(step, record | record_extra)
                    record_extra = {}
                    progress.update(step, record["loss"], record)
                    for hook in records.hooks:
                        hook(step, state, record)
                    last_log_step, last_log_time = step, time.perf_counter()
                ledger.switch("other")  # after an unlogged step: it was only dispatched
                preempted = preemption.reached(steps_run)  # a number that only grows
                if checkpoints is not None:
                    checkpoints.check()  # a save that failed to write stops the run here
                    if checkpoints.due(step) or preempted or is_last:
                        with ledger.timing("steps"):  # it waits for the step to finish
                            self._nonfinite_steps(state, step)  # never save a state holding NaN
                        with watchdog.paused(f"checkpoint save at step {step}"):
                            with ledger.timing("save"):
                                state = self._save(state, step, placed.get_state())
                        ledger.checkpoint_saved(step)
                if preempted:
                    stopped_at = step
                    break
                ledger.tick(step)
        finally:
            watchdog.close()
            profiler.stop()
            preemption.close()
            progress.close()
            writer.close()
            if checkpoints is not None:
                with ledger.timing("save"):
                    checkpoints.wait()  # a started save is a good one: let it commit
                checkpoints.close()
            spent = ledger.end()
        if is_writer and records.goodput_line:
            logging.info("%s", goodput.summary_line(spent))
        if stopped_at is not None:
            saved = "saved a checkpoint" if checkpoints is not None else "saved nothing"
            where = f"at step {stopped_at}"
            if preemption.interrupted:
                logging.warning("interrupted: %s %s", saved, where)
                raise KeyboardInterrupt(f"{saved} {where} in {os.path.abspath(self.workdir)}")
            logging.warning(
                "preempted: %s %s and stopping; run the same command to resume", saved, where
            )
        return state

    def _first_step_report(self, state, batch) -> dict:
        """Logs the run's shape, sets up the speed report and returns the memory report (for
        the first record), all known once the first batch is placed."""
        trainer = self.trainer
        global_batch_size = self.rows[0] * trainer.row_block[1]
        logging.info(
            "%d parameters, strategy %s on %d devices (mesh %s), global batch %d (%d per batch "
            "slice x %d accumulation steps)",
            sum(x.size for x in jax.tree.leaves(state.params)),
            trainer.strategy.name,
            trainer.num_devices,
            ",".join(f"{a}:{n}" for a, n in trainer.strategy.mesh.shape.items()),
            global_batch_size,
            global_batch_size // (trainer.batch_slices * trainer.task.grad_accum_steps),
            trainer.task.grad_accum_steps,
        )
        records = self.settings.records
        self.throughput = _throughput(
            trainer, self.sample_batch, global_batch_size, records.tokens_per_example,
            records.peak_flops_per_device,
        )  # fmt: skip
        return _memory_report(trainer, state, batch)

    def _roll_back_if_bad(self, state, metrics, step: int, watchdog):
        """(the newest checkpoint's state, its step, the metrics note) when step `step` must be
        undone (nan_policy=rollback); None when it stands."""
        loss, nonfinite = jax.device_get((metrics["loss"], state.nonfinite_steps))
        reason = self.rollbacks.bad(float(loss), bool(nonfinite))
        if reason is None:
            return None
        checkpoints = self.checkpoints
        with watchdog.paused(f"rollback at step {step}"):
            with self.ledger.timing("save"):
                checkpoints.wait()  # a save in flight is a checkpoint to go back to
            with self.ledger.timing("restore"):
                to_step, restored, _ = checkpoints.restore_latest(
                    self.trainer.abstract_state(self.sample_batch),
                    self.settings.checkpointing.check,
                    store.restore_layout,
                    fix="or pass a new workdir to train afresh",
                )
        note = self.rollbacks.rolled_back(step, to_step, reason)
        logging.warning(
            "rollback: %s at step %d; restored the checkpoint at step %d and skipped batches "
            "%d-%d",
            reason, step, to_step, *note["skipped_batches"],
        )  # fmt: skip
        return restored, to_step, note

    def _save(self, state, step: int, data_state) -> TrainState:
        state = self.trainer.consolidate(state)  # continue from what is saved
        meta = checkpoint_meta(self.trainer, step, data_state) | dict(
            self.settings.checkpointing.meta
        )
        if self.rollbacks is not None:  # a resume skips them too
            meta[SKIPPED] = self.rollbacks.skipped
        self.checkpoints.save(step, self.trainer.global_state(state), meta, force=True)
        return state

    def _nonfinite_steps(self, state, step: int) -> int:
        """The count of non-finite steps so far; unless the trainer skips them, any is the end."""
        count = int(state.nonfinite_steps)
        if count and not self.trainer.task.skip_nonfinite:
            raise TrainingHalted(
                f"loss or gradients became non-finite by step {step}; stopped without saving it, "
                "the checkpoints already in the workdir are untouched; lower the learning rate, "
                "set grad_clip_norm, or set nan_policy=skip (Trainer(skip_nonfinite=True)) to "
                "drop such updates"
            )
        return count


def evaluate_metrics(trainer, state, batches, extras=None) -> dict[str, float]:
    """`trainer.evaluate` over `batches`, plus `extras(means)` (such as perplexity)."""
    means = trainer.evaluate(state, batches)
    return means | (extras(means) if extras else {})


def checkpoint_meta(trainer, step: int, data_state) -> dict:
    """What a checkpoint records besides the state: enough to know what wrote it."""
    return {
        "step": step,
        "jddp_version": __version__,
        "strategy": trainer.strategy.name,
        "mesh": {name: int(size) for name, size in trainer.strategy.mesh.shape.items()},
        "devices": trainer.num_devices,
        "processes": jax.process_count(),
        "data": data_state,
    }


# ------------------------------------------------------------------------------ the start
def _restore_or_start(trainer, checkpoints, sample_batch, seed, given, check, ledger):
    """(start step, state, the restored checkpoint's metadata or {})."""
    if checkpoints is not None and checkpoints.steps():
        abstract = trainer.abstract_state(sample_batch)
        with ledger.timing("restore"):
            step, state, meta = checkpoints.restore_latest(
                abstract, check, store.restore_layout, fix="or pass a new workdir to train afresh"
            )
        return step, state, meta
    if given is None:
        return 0, trainer.init(seed, sample_batch), {}
    return 0, given() if callable(given) else given, {}


def _peek(batches):
    """(first batch, whether `batches` was set back before it: get_state / set_state), or None
    when there is no batch."""
    saved = batches.get_state() if hasattr(batches, "get_state") else None
    batch = next(batches, None)
    if batch is None:
        return None
    if saved is None or not hasattr(batches, "set_state"):
        return batch, False
    batches.set_state(saved)
    return batch, True


def _position(batches, start_step: int, data_state) -> None:
    """Moves `batches` past the `start_step` batches already trained on."""
    if not start_step:
        return
    if data_state is not None and hasattr(batches, "set_state"):
        batches.set_state(data_state)
        return
    for done in range(start_step):
        if next(batches, None) is None:
            raise DataError(
                f"train_batches ended after {done} batches, but the checkpoint being resumed "
                f"is at step {start_step}; pass the batches it was trained on"
            )


def check_train_batches(batches) -> None:
    """Where the iterator says how many examples it draws from (jddp.data.train_batches does,
    in its state): none is a DataError, and a global batch larger than that one warning (it
    trains, but each batch then repeats examples: not the batch size the run asked for)."""
    state = batches.get_state() if hasattr(batches, "get_state") else None
    if not isinstance(state, Mapping):
        return
    size, examples = state.get("global_batch_size"), state.get("num_examples")
    if not (isinstance(size, int) and isinstance(examples, int)):
        return
    if examples == 0:
        raise DataError("the training set has no examples; point the data at a non-empty split")
    if size > examples and jax.process_index() == 0:
        logging.warning(
            "global_batch_size=%d is larger than the training set (%d examples): every batch "
            "holds some examples more than once; use a global batch size of at most %d, or more "
            "data",
            size, examples, examples,
        )  # fmt: skip


def _eval_pass(eval_batches):
    """A zero-argument function giving one pass over the eval batches, or None."""
    if eval_batches is None or callable(eval_batches):
        return eval_batches
    if iter(eval_batches) is eval_batches:
        raise ConfigError(
            "eval_batches is a one-pass iterator; pass a list of batches, or a zero-argument "
            "function that returns a fresh iterable for each evaluation"
        )
    return lambda: eval_batches


def _rows(batch) -> int:
    return int(np.shape(next(iter(jax.tree.leaves(batch))))[0])


def _checksum(state) -> float:
    """Sum of the replicated leaves of `state` as this process sees them (under ddp: all)."""
    return float(
        sum(
            np.sum(np.asarray(x.addressable_shards[0].data), dtype=np.float64)
            for x in jax.tree.leaves(state)
            if x.sharding.is_fully_replicated
        )
    )


# ----------------------------------------------------------------------------- reports
def _memory_report(trainer, state, batch) -> dict:
    """Bytes per device of the state and the compiled step (and the pipeline's shape), logged
    and returned for the first record."""
    memory = trainer.memory_report(state, batch)
    logging.info(
        "per device: state (parameters + optimizer state) %s, compiled step peak %s, "
        "collectives %s per step",
        format_bytes(memory["state_bytes_per_device"]),
        format_bytes(memory["peak_bytes_per_device"]),
        format_bytes(memory["comm_bytes_per_step"]),
    )
    pipeline = trainer.strategy.pipeline
    if pipeline:
        memory |= pipeline.describe()
        logging.info(
            "pipeline: %s over %d stages, %d micro-batches, bubble (S-1)/(M+S-1) = %.1f%%",
            pipeline.schedule.name,
            pipeline.schedule.stages,
            pipeline.schedule.microbatches,
            100 * memory["pipeline_bubble"],
        )
    context = trainer.strategy.context_axis
    if context:
        size = trainer.strategy.device_mesh.size(context)
        attention = getattr(trainer.task.model, "context_attention", "own")
        memory["context"] = {"size": size, "attention": attention}
        logging.info(
            "context parallelism: every sequence cut into %d chunks, 2 per device over "
            "context:%d; %s attention",
            2 * size,
            size,
            attention,
        )
    return memory


def _throughput(trainer, sample_batch, global_batch_size, tokens_per_example, peak) -> Throughput:
    """Speed reporting: model FLOPs of one global step (jddp/observe/flops.py) and the device's
    peak."""
    key = trainer.task.input_key
    step_flops = None
    if isinstance(key, str):
        inputs = np.asarray(sample_batch[key])
        global_inputs = jax.ShapeDtypeStruct((global_batch_size, *inputs.shape[1:]), inputs.dtype)
        step_flops = flops.train_step_flops(trainer.task.model, global_inputs)
    dtype = np.dtype(trainer.task.compute_dtype).name
    peak, peak_source = device_peak.peak_flops_per_device(jax.local_devices()[0], dtype, peak)
    logging.info(
        "model FLOPs per step: %s; peak FLOP/s per device: %s (%s)",
        f"{step_flops.per_step:.4g} ({step_flops.method})" if step_flops else "unknown",
        f"{peak:.4g}" if peak else "unknown",
        peak_source,
    )
    return Throughput(
        examples_per_step=global_batch_size,
        num_devices=jax.device_count(),
        tokens_per_example=tokens_per_example,
        flops_per_step=step_flops.per_step if step_flops else None,
        peak_flops_per_device=peak,
    )
