"""The steps of one `fit` call: the step, then what is registered (records, evaluation,
preemption, checkpoints; jddp/loop/hooks.py) at its cadence, with the goodput ledger, the hang
watchdog, the profiler and nan_policy=rollback around them."""

import dataclasses
import os

import jax
from absl import logging

from jddp.checkpoints.compatibility import restore_layout
from jddp.checkpoints.store import Checkpoints
from jddp.core.state import TrainState
from jddp.errors import DataError
from jddp.loop import hooks
from jddp.loop.hooks import Tick
from jddp.loop.reports import first_step_report
from jddp.loop.settings import Batch, Settings
from jddp.observe import goodput
from jddp.observe.profiling import StepProfiler
from jddp.runtime.preemption import PreemptionWatch
from jddp.runtime.rollback import Rollbacks
from jddp.runtime.watchdog import HangWatchdog
from jddp.trainer import Trainer


@dataclasses.dataclass
class Steps:
    """The steps from `start_step` to `settings.num_steps`, with what watches and records them
    (`settings`, as `fit` checked them)."""

    trainer: Trainer
    workdir: str
    settings: Settings
    start_step: int
    checkpoints: Checkpoints | None
    rows: list[int]  # the first batch's rows, once it is placed: the global batch size follows
    sample_batch: Batch
    rollbacks: Rollbacks | None  # nan_policy=rollback's decisions, or None
    ledger: goodput.Ledger  # the stopwatch: every second of the start is in one category

    def run(self, state: TrainState, placed) -> TrainState:
        settings, ledger, num_steps = self.settings, self.ledger, self.settings.num_steps
        ledger.switch("other")  # the loop begins: its own work, unless a category says more
        ledger.flush()
        preemption = PreemptionWatch()
        profiler = StepProfiler(os.path.join(self.workdir, "profile"), *settings.profile_steps)
        watchdog = HangWatchdog.start(settings.hang_timeout_s, self.workdir)
        evaluator = hooks.Evaluator(self.trainer, settings.evaluation, watchdog, ledger)
        records = hooks.RecordKeeper(
            self.trainer, settings.records, num_steps, self.workdir, self.start_step, ledger,
            evaluator.due,
        )  # fmt: skip
        saver = hooks.Saver(
            self.trainer, self.checkpoints, settings.checkpointing, self.rollbacks, placed,
            watchdog, preemption, ledger,
        )  # fmt: skip
        registered = (  # (when, what), in this order after every step
            (records.due, records.open),
            (evaluator.due, evaluator),
            (records.opened, records.write),
            *[(work.due, work) for work in (hooks.PreemptionCheck(preemption, ledger), saver)],
        )
        step, steps_run, tick = self.start_step, 0, None
        try:
            records.start()
            if self.rollbacks and not self.checkpoints.steps():  # a checkpoint to go back to
                state = saver.save(state, 0)
            while step < num_steps:
                step, steps_run = step + 1, steps_run + 1
                batch = self._next_batch(placed, step)
                first = steps_run == 1  # this start's first step compiles
                ledger.switch("compile" if first else "steps")
                if first:
                    records.first_step(*self._first_step_report(state, batch))
                state, metrics = self._step(state, batch, step, watchdog, profiler)
                if first:  # compilation: time the steady state from here
                    metrics["loss"].block_until_ready()
                    records.compiled()
                if self.rollbacks is not None:
                    undone = self._roll_back_if_bad(state, metrics, step, watchdog)
                    if undone is not None:
                        state, step = self._rewind(step, undone, records)
                        continue
                ledger.step_done(step)
                tick = Tick(step, steps_run, state, metrics, first, last=step == num_steps)
                for due, work in registered:
                    if due(tick):
                        work(tick)
                state = tick.state  # a save goes on from the state it saved
                if tick.preempted:
                    break
                ledger.tick(step)
        finally:
            profiler.stop()
            records.close()
            try:
                if self.checkpoints is not None:
                    # A started save is a good one: it commits, watched, whatever signal comes.
                    saver.wait()
                    self.checkpoints.close()
            finally:
                watchdog.close()
                preemption.close()
            spent = ledger.end()
        if jax.process_index() == 0 and settings.records.goodput_line:
            logging.info("%s", goodput.summary_line(spent))
        if tick is not None and (tick.preempted or preemption.interrupted):
            hooks.log_stop(preemption, self.checkpoints, tick.step, self.workdir)
        return state

    def _next_batch(self, placed, step: int):
        with self.ledger.timing("data"):
            batch = next(placed, None)
        if batch is None:
            raise DataError(
                f"train_batches ran out before step {step}; num_steps={self.settings.num_steps} "
                "needs one batch per step: repeat the data, or lower num_steps"
            )
        return batch

    def _step(self, state, batch, step: int, watchdog, profiler):
        """The step, up to what waits for its results, watched and maybe profiled."""
        watchdog.dispatching(step)  # a dispatch may wait in a collective itself
        with profiler.step(step):
            state, metrics = self.trainer.step(state, batch)
        watchdog.dispatched(step, metrics["loss"])
        profiler.after(step, metrics["loss"])
        return state, metrics

    def _first_step_report(self, state, batch):
        global_batch_size = self.rows[0] * self.trainer.row_block[1]
        return first_step_report(
            self.trainer, state, batch, self.sample_batch, global_batch_size,
            self.settings.records,
        )  # fmt: skip

    def _roll_back_if_bad(self, state, metrics, step: int, watchdog):
        """(the newest checkpoint's state, its step, the metrics note) when step `step` must be
        undone (nan_policy=rollback); None when it stands."""
        loss, nonfinite = jax.device_get((metrics["loss"], state.nonfinite_steps))
        reason = self.rollbacks.bad(float(loss), bool(nonfinite))
        if reason is None:
            return None
        with watchdog.paused(f"rollback at step {step}"):
            with self.ledger.timing("save"):
                self.checkpoints.wait()  # a save in flight is a checkpoint to go back to
            with self.ledger.timing("restore"):
                to_step, restored, _ = self.checkpoints.restore_latest(
                    self.trainer.abstract_state(self.sample_batch),
                    self.settings.checkpointing.check,
                    restore_layout,
                    fix="or pass a new workdir to train afresh",
                )
        note = self.rollbacks.rolled_back(step, to_step, reason)
        logging.warning(
            "rollback: %s at step %d; restored the checkpoint at step %d and skipped batches "
            "%d-%d",
            reason, step, to_step, *note["skipped_batches"],
        )  # fmt: skip
        return restored, to_step, note

    def _rewind(self, step: int, undone, records) -> tuple[TrainState, int]:
        """(the restored state, its step): the steps since it were lost."""
        state, to_step, note = undone
        self.ledger.step_done(step)
        self.ledger.rewind(to_step)
        self.ledger.switch("other")
        records.rewound(to_step, note)
        return state, to_step
