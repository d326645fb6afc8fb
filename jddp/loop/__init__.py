"""`fit`: the training loop of the library and of the CLI (for your own loop, `jddp.save` /
`jddp.restore` checkpoint any state: jddp/checkpoints/save_restore.py).

    state = jddp.fit(trainer, batches, workdir="runs/a", num_steps=1000, eval_batches=eval_set)

`fit` owns its workdir: `metrics.jsonl` and the trackers' records (TensorBoard files, or W&B and
MLflow runs: `writers=`), the progress line, evaluation,
checkpoints with exact resume (the same call again continues bit for bit), a save on SIGTERM and
on Ctrl-C, the hang watchdog, the throughput / MFU / memory report, where the wall time went
(goodput, over every start of the workdir), and a lock that keeps a second run out. See
docs/loop.md.

`fit` checks, holds the workdir and calls `train`, the loop in a workdir already checked and held,
which takes its settings as one object per concern (`Settings`: jddp/loop/settings.py); the CLI
(jddp/run/experiment.py) calls `train` after its own checks.
"""

import json
import os
from collections.abc import Callable, Iterable, Mapping

import jax
from absl import logging

from jddp.checkpoints.folder import check_checkpoints_dir
from jddp.checkpoints.store import Checkpoints
from jddp.core.state import TrainState
from jddp.data.prefetch import prefetch_to_device
from jddp.errors import ConfigError
from jddp.loop import start
from jddp.loop.hooks import SKIPPED, evaluate_metrics
from jddp.loop.settings import Batch, Checkpointing, Evaluation, Hook, Records, Settings
from jddp.loop.start import check_train_batches, checkpoint_meta
from jddp.loop.steps import Steps
from jddp.observe import goodput
from jddp.observe.writers import DEFAULT_WRITERS
from jddp.runtime import processes
from jddp.runtime.rollback import RollbackPolicy, Rollbacks
from jddp.runtime.watchdog import HangBound
from jddp.runtime.workdir import check_workdir, hold_workdir

__all__ = [
    "SKIPPED",
    "Checkpointing",
    "Evaluation",
    "Records",
    "Settings",
    "check_train_batches",
    "checkpoint_meta",
    "evaluate_metrics",
    "fit",
    "train",
]


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
    hang_timeout_s: float | HangBound | None = None,
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
    writers: str | Iterable = DEFAULT_WRITERS,
    config: Mapping | None = None,
) -> TrainState:
    """Trains `trainer` on `train_batches` up to step `num_steps` in `workdir`; returns the
    final state (on SIGTERM: the state it saved, whose `step` is below `num_steps`).

    A rerun of the same call resumes from the newest checkpoint in `workdir`, skipping the
    batches already trained on (through `get_state()` / `set_state()` when the iterator has them,
    as grain's do). Ctrl-C saves at the end of the step and raises KeyboardInterrupt. Each
    record goes to metrics.jsonl and to the trackers in `writers` (tensorboard, wandb, mlflow,
    or `jddp.observe.writers.Writer`s; docs/trackers.md), which record `config`. Every
    argument is described in docs/loop.md; the keywords after `state` are `Settings`' (which
    `train` takes whole).
    """
    ledger = _ledger(workdir, started_at)  # goodput's `startup` runs until the loop begins
    settings = Settings(
        num_steps=num_steps,
        checkpointing=Checkpointing(
            checkpoint_every, max_to_keep, dict(checkpoint_meta or {}), check_checkpoint
        ),
        records=Records(
            log_every,
            tuple(hooks),
            learning_rate,
            tokens_per_example,
            peak_flops_per_device,
            dict(notes or {}),
            writers=writers,
            config=dict(config or {}),
        ),  # fmt: skip
        evaluation=Evaluation(eval_batches, eval_every, eval_extras),
        rollback=rollback,
        hang_timeout_s=hang_timeout_s,
        profile_steps=profile_steps,
        device_prefetch=device_prefetch,
    )
    check_checkpoints_dir(os.path.join(workdir, "checkpoints"), checkpointing=checkpoint_every > 0)
    check_workdir(workdir, resumable=checkpoint_every > 0, name="workdir")
    # An iterator is used as it is (one with `__next__` but no `__iter__` too), else iterated.
    batches = train_batches if hasattr(train_batches, "__next__") else iter(train_batches)
    check_train_batches(batches)
    if sample_batch is None:
        batches, sample_batch = start.first_batch(batches)
    trainer.check_layout(sample_batch)
    processes.barrier("fit: checks done")
    with hold_workdir(workdir):
        return train(
            trainer, batches, workdir, settings, sample_batch, seed=seed, state=state,
            ledger=ledger,
        )  # fmt: skip


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
    """`fit`'s loop in a `workdir` its caller has checked (`check_workdir`) and holds
    (`hold_workdir`), over a `batches` iterator it has checked (`check_train_batches`) whose
    batches `sample_batch` shapes: resumes the newest checkpoint, else starts from `state` (a
    state, or a function giving one) or from `seed`. Goodput's ledger (`ledger`, else one
    started at `started_at`, default now) counts the time."""
    ledger = ledger or _ledger(workdir, started_at)
    checkpointing = settings.checkpointing
    checkpoints = None
    if checkpointing.every > 0:
        checkpoints = Checkpoints(
            os.path.join(workdir, "checkpoints"),
            every=checkpointing.every,
            max_to_keep=checkpointing.max_to_keep,
            holds_workdir=True,  # `train` runs in a workdir its caller holds
        )
    try:
        start_step, state, saved = start.restore_or_start(
            trainer, checkpoints, sample_batch, seed, state, checkpointing.check, ledger
        )
        rollbacks = Rollbacks(settings.rollback, saved.get(SKIPPED)) if settings.rollback else None
        if start_step > settings.num_steps:
            raise ConfigError(
                f"the checkpoints in {checkpoints.directory} reach step {start_step}, past "
                f"num_steps={settings.num_steps}; raise num_steps or pass another workdir"
            )
        skipped = rollbacks.skipped_batches if rollbacks else 0
        start.position(batches, start_step + skipped, saved.get("data"))
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
        [json.dumps(dict(checkpointing.meta), sort_keys=True, default=str), start.checksum(state)],
    )
    rows = []  # of the first batch: the global batch size follows

    def place(batch):
        if not rows:
            rows.append(start.rows(batch))
        return trainer.place_batch(batch)

    placed = prefetch_to_device(batches, place, settings.device_prefetch)
    ledger.begin(start_step)
    steps = Steps(
        trainer, workdir, settings, start_step, checkpoints, rows, sample_batch, rollbacks, ledger
    )
    return steps.run(state, placed)


def _ledger(workdir: str, started_at: float | None) -> goodput.Ledger:
    """Where the time goes (jddp/observe/goodput.py), kept by process 0 in workdir/goodput.json."""
    return goodput.Ledger(workdir if jax.process_index() == 0 else None, started_at=started_at)
