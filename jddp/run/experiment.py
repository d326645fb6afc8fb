"""`train_and_evaluate(config, workdir)`: one experiment config trained from start to end.

Read top to bottom: checks (nothing written; the workdir's newest checkpoint read once), data,
then `jddp.fit`'s loop (`jddp.loop.train` in the workdir held here, settings passed one object per
concern: resume and checkpoints included), then the export and summary. What is
config-specific stays here: the config's own checks, the config stored with each checkpoint and
compared on resume (jddp/run/resume.py), `init_from`, `config.json` and `summary.json`.
"""

import json
import os
import time

import jax
import ml_collections
from absl import logging

from jddp import data, loop
from jddp.checkpoints import hf
from jddp.checkpoints.export import export_params
from jddp.checkpoints.folder import check_checkpoints_dir
from jddp.checkpoints.newest import NewestCheckpoint
from jddp.core.task import check_divisible
from jddp.errors import ConfigError
from jddp.observe import goodput
from jddp.run import config as config_lib
from jddp.run import elastic, factory, optim, resume
from jddp.run.input_check import check_model_takes_data
from jddp.runtime import atomic_write
from jddp.runtime import processes as runtime
from jddp.runtime import workdir as workdir_lib
from jddp.runtime.rollback import RollbackPolicy

SUMMARY = "summary.json"


def check_workdir(workdir: str, *, resumable: bool) -> None:
    """`jddp.runtime.workdir.check_workdir` and the checkpoint folder's own checks (readable;
    checkpoints only where checkpointing is on), their fixes worded for the command line."""
    check_checkpoints_dir(
        os.path.join(workdir, "checkpoints"),
        checkpointing=resumable,
        names=("--workdir", "--config.checkpoint_every"),
    )
    workdir_lib.check_workdir(workdir, resumable=resumable, name="--workdir")


def write_config(workdir: str, config) -> None:
    """`config.json`, unless it already holds this config (a resume leaves it untouched)."""
    path, text = (
        os.path.join(workdir, "config.json"),
        config.to_json_best_effort(indent=2, sort_keys=True) + "\n",
    )
    try:
        with open(path, "rb") as f:  # bytes: a file torn by an older version may not decode
            if f.read() == text.encode():
                return
    except OSError:  # none yet, or unreadable: written anew
        pass
    atomic_write.write_text(path, text)


def check_checkpoint_data(config, dataset: data.DatasetSpec) -> None:
    """A Hugging Face checkpoint reads its tokenizer's ids (character-level text would train it
    on other tokens without a word; another tokenizer's ids beyond its vocabulary are refused)
    and sequences no longer than its positions."""
    if not hf.is_hf(config.init_from) or dataset.kind != data.LANGUAGE_MODEL:
        return
    where = hf.directory(config.init_from)
    if not dataset.tokenizer:
        raise ConfigError(
            f"init_from {config.init_from!r} is a model of its tokenizer's tokens, and dataset "
            f"{config.dataset!r} is tokenized by characters; set data.tokenizer (e.g. "
            f"{os.path.join(where, 'tokenizer.json')})"
        )
    vocab_size = config.model_args.get("vocab_size")
    if vocab_size:  # its embedding has a row for each of its tokenizer's ids, and no more
        dataset.tokenizer.check_fits(
            vocab_size,
            f"init_from {config.init_from!r} (its config.json)",
            f"set data.tokenizer to the checkpoint's own ({os.path.join(where, 'tokenizer.json')})",
        )
    longest = config.model_args.get("max_seq_len")
    if longest and config.data.seq_len > longest:
        raise ConfigError(
            f"data.seq_len={config.data.seq_len} is longer than the {longest} positions of "
            f"init_from {config.init_from!r} (its config.json); use a data.seq_len of at most "
            f"{longest}"
        )


def check_eval_batch_size(eval_batch_size: int, slices: int) -> None:
    """A ConfigError unless eval batches split evenly into `slices` (one per device, except that
    the devices of a tensor group or of the stages share one)."""
    if eval_batch_size % slices:
        below = eval_batch_size // slices * slices
        nearest = " or ".join(str(n) for n in (below, below + slices) if n > 0)
        raise ConfigError(
            f"eval_batch_size={eval_batch_size} is not divisible by the {slices} devices that "
            f"split each batch; use a multiple of {slices}, e.g. {nearest} (0: "
            "global_batch_size)"
        )


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, started_at: float | None = None
) -> dict:
    """Trains `config` into `workdir`, resuming its newest checkpoint if it has one; returns the
    final eval metrics, the wall time and (process 0) the run's goodput (or `preempted` and the
    step it saved). `started_at`: the `time.time()` the program started, where goodput's
    `startup` begins (default: when the loop begins)."""
    start_time = time.perf_counter()
    # ---------------------------------------- checks, model, trainer (nothing written yet)
    config_lib.validate(config)
    check_workdir(workdir, resumable=config.checkpoint_every > 0)
    # What the workdir holds, read once: the model's arguments, the elastic accumulation and
    # the checks before resuming all take it from here.
    newest = NewestCheckpoint.read(workdir, checkpointing=config.checkpoint_every > 0)
    config = factory.with_checkpoint_model_args(config, newest)
    dataset = factory.dataset_spec(config)
    check_checkpoint_data(config, dataset)
    schedule = optim.learning_rate_schedule(config)
    device_mesh = factory.mesh_for(config)
    # Fewer devices than the run began with accumulate more (from the config and the mesh,
    # before the trainer is built: it is built once).
    accum = elastic.accumulation(
        config.global_batch_size,
        factory.batch_splits(config, device_mesh),
        config.grad_accum_steps,
        newest.meta,
    )
    trainer = factory.build_trainer(
        config, dataset, schedule, mesh=device_mesh, grad_accum_steps=accum.steps
    )
    objective = factory.objective(dataset)
    check_divisible(config.global_batch_size, trainer.batch_slices, accum.steps)
    eval_batch_size = config.eval_batch_size or config.global_batch_size
    check_eval_batch_size(eval_batch_size, trainer.batch_slices)

    # ------------------------------------------- data (a missing or bad dataset leaves no workdir)
    data_options = data.DataOptions.from_config(config.data)
    splits = data.open_dataset(dataset, data_options)
    sample_batch = factory.sample_batch(config, dataset, splits)
    check_model_takes_data(trainer.task, sample_batch, config.model, config.dataset, dataset)
    trainer.check_layout(sample_batch, config.global_batch_size)
    # Each process reads only its block of every global batch (see jddp/data/loader.py):
    # block `block` of `blocks`; pipeline stages on other hosts read the same block.
    block, blocks = trainer.row_block
    processes = {"process_index": block, "process_count": blocks}
    batches = data.train_batches(
        splits.train,
        splits.transform,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        threads=data_options.threads,
        workers=data_options.workers,
        **processes,
    )
    loop.check_train_batches(batches)
    start = resume.check_before_start(newest, config, trainer, sample_batch, batches)

    def eval_pass():
        return data.eval_batches(
            splits.eval,
            splits.transform,
            batch_size=eval_batch_size,
            threads=data_options.threads,
            **processes,
        )

    abstract = trainer.abstract_state(sample_batch)
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))

    def check_config(meta, saved_shapes):  # the config a checkpoint was written with
        resume.check_resumable(meta, saved_shapes, config, abstract, directory)

    final_eval, config_written = {}, []

    def record_hook(step, state, record):
        # config.json once the run has started (a resume that fails leaves the old one).
        if not config_written and jax.process_index() == 0:
            write_config(workdir, config)
            config_written.append(True)
        final_eval.update({k[5:]: v for k, v in record.items() if k.startswith("eval_")})

    notes = {"config_changes": start.config_changes} if start.config_changes else {}
    notes |= elastic.note(
        newest.meta, accum, config.grad_accum_steps, jax.device_count(), jax.process_count()
    )
    settings = loop.Settings(
        num_steps=config.num_train_steps,
        checkpointing=loop.Checkpointing(
            every=config.checkpoint_every,
            max_to_keep=config.max_to_keep,
            meta={
                "config": json.loads(config.to_json_best_effort()),
                elastic.MICRO_BATCH: accum.micro_batch,
            },
            check=check_config,
        ),
        records=loop.Records(
            every=config.log_every,
            hooks=(record_hook,),
            learning_rate=schedule,
            tokens_per_example=objective.tokens_per_example(sample_batch),
            example_unit="rows" if dataset.packed else "examples",
            peak_flops_per_device=config.peak_flops_per_device,
            notes=notes,
            goodput_line=False,  # jddp-train prints the workdir's at exit, after the export
            writers=config.log.writers,
            config=json.loads(config.to_json_best_effort()),
        ),
        evaluation=loop.Evaluation(eval_pass, config.eval_every, objective.eval_extras),
        rollback=_rollback_policy(config),
        hang_timeout_s=config.hang_timeout_s,
        profile_steps=(config.profile_start_step, config.profile_num_steps),
        device_prefetch=data_options.device_prefetch,
    )
    runtime.barrier("checks done")  # no process writes before every process has looked

    # ------------------------------------------------- the loop (jddp.fit's, workdir held once)
    with workdir_lib.hold_workdir(workdir):
        logging.info("workdir: %s", os.path.abspath(workdir))
        logging.info("%s on %s", config.model, config.dataset)
        try:
            state = loop.train(
                trainer,
                batches if start.data_order_continues else _ThisConfigsOrder(batches),
                workdir,
                settings,
                sample_batch,
                # only when there is no checkpoint to resume
                state=lambda: resume.fresh_state(trainer, config, sample_batch),
                started_at=started_at,
            )
        finally:
            batches.close()

        # -------------------------------------------------------------- export & summary
        step = int(state.step)
        if step < config.num_train_steps:
            return {
                "preempted": True,
                "step": step,
                "wall_time_sec": time.perf_counter() - start_time,
            }
        finished = _finished_summary(workdir, config, start.resume_step)
        if finished is not None:
            return finished
        record_hook(step, state, {})
        if not final_eval:  # resumed at the last step, before its export
            final_eval = loop.evaluate_metrics(trainer, state, eval_pass(), objective.eval_extras)
        write_export(workdir, trainer.host_state(state).params)
        summary = {f"eval_{k}": v for k, v in final_eval.items() if k != "count"}
        summary["wall_time_sec"] = time.perf_counter() - start_time
        if jax.process_index() == 0:
            summary["goodput"] = goodput.summary_of(workdir)  # every start of the workdir
            atomic_write.write_json(
                os.path.join(workdir, SUMMARY),
                {"step": config.num_train_steps, **summary},
                indent=2,
            )
        return summary


def write_export(workdir: str, params) -> None:
    """`params` saved to `workdir/export` (every process calls it); an export already there is
    replaced only once the new one is complete (written beside it, then swapped in)."""
    export = os.path.join(workdir, "export")
    with atomic_write.replacing_directory(export, swap=jax.process_index() == 0) as staged:
        export_params(staged, params)


def _rollback_policy(config) -> RollbackPolicy | None:
    if config.nan_policy != "rollback":
        return None
    return RollbackPolicy(config.spike_factor, config.spike_window, config.max_rollbacks)


class _ThisConfigsOrder:
    """The data iterator of a resume allowed to change the data (allow_config_change): it goes
    on from the saved step in this config's order, not the saved one."""

    def __init__(self, batches):
        self._batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._batches)

    def get_state(self):
        return self._batches.get_state()

    def set_state(self, state) -> None:
        self._batches.set_state({**self._batches.get_state(), "step": state["step"]})


def _finished_summary(workdir: str, config, resume_step) -> dict | None:
    """The saved summary of a run that already reached `num_train_steps` and was exported
    (running it again changes nothing), else None."""
    path = os.path.join(workdir, SUMMARY)
    exported = os.path.isdir(os.path.join(workdir, "export"))
    if resume_step != config.num_train_steps or not (exported and os.path.exists(path)):
        return None
    try:
        with open(path, "rb") as f:
            summary = json.loads(f.read())
        if not isinstance(summary, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:  # torn by an older version's crash: summarized again
        logging.warning("%s is unreadable (%s); evaluating and exporting again", path, e)
        return None
    logging.info("%s already finished at step %d; nothing to do", workdir, resume_step)
    summary.pop("step", None)
    return summary
