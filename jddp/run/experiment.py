"""`train_and_evaluate(config, workdir)`: one experiment config trained from start to end.

Read top to bottom: checks, workdir, data, state (resumed, init_from or fresh), the loop with
its checkpoints, the export and summary.
"""

import json
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from jddp import data
from jddp.checkpoints import store as checkpoint
from jddp.checkpoints.store import Checkpoints
from jddp.core.task import check_divisible
from jddp.errors import ConfigError, TrainingHalted, WorkdirError
from jddp.observe import device_peak, flops
from jddp.observe.memory import format_bytes
from jddp.observe.metrics_writer import MetricsWriter
from jddp.observe.profiling import StepProfiler
from jddp.observe.progress import Progress
from jddp.observe.throughput import Throughput
from jddp.run import config as config_lib
from jddp.run import factory, optim, resume
from jddp.run.model_fit import check_model_fits
from jddp.runtime import processes as runtime
from jddp.runtime.fs import directory_problem
from jddp.runtime.preemption import PreemptionWatch
from jddp.runtime.watchdog import HangWatchdog


def check_workdir(workdir: str, *, resumable: bool) -> None:
    """Refuses, without writing: a path that cannot be a writable directory, and a directory
    holding a run this one cannot continue (one without checkpoints, or when checkpointing is
    off, or whose checkpoints were all damaged and set aside)."""
    problem = directory_problem(workdir, write=True)
    if problem:
        raise WorkdirError(
            f"workdir {workdir!r} {problem}; pass a directory you can write to as --workdir"
        )
    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        return
    if not (resumable and os.path.isdir(checkpoints)):
        raise WorkdirError(
            f"workdir {workdir!r} already holds a run without checkpoints to resume "
            "(metrics.jsonl); pass a new --workdir"
        )
    damaged = os.path.join(workdir, "checkpoints_damaged")
    if os.path.isdir(damaged) and not any(name.isdigit() for name in os.listdir(checkpoints)):
        raise WorkdirError(
            f"workdir {workdir!r} holds a run whose checkpoints were all damaged (set aside in "
            f"{damaged}); pass a new --workdir to train afresh"
        )


def prepare_workdir(workdir: str) -> None:
    """Creates `workdir` (checked by `check_workdir`, so this fails only on a race)."""
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise WorkdirError(f"workdir {workdir!r} cannot be created: {e.strerror}") from None


def write_config(workdir: str, config) -> None:
    """`config.json`, unless it already holds this config (a resume leaves it untouched)."""
    path, text = (
        os.path.join(workdir, "config.json"),
        config.to_json_best_effort(indent=2, sort_keys=True) + "\n",
    )
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains `config` into `workdir`, resuming its newest checkpoint if it has one; returns the
    final eval metrics and the wall time (or `preempted` and the step it saved)."""
    start_time = time.perf_counter()
    # ---------------------------------------- checks, model, trainer (nothing written yet)
    config_lib.validate(config)
    check_workdir(workdir, resumable=config.checkpoint_every > 0)
    dataset = factory.dataset_spec(config)
    schedule = optim.learning_rate_schedule(config)
    trainer = factory.build_trainer(config, dataset, schedule)
    objective = factory.objective(dataset)
    num_devices, batch_shards = trainer.num_devices, trainer.batch_shards
    check_divisible(config.global_batch_size, batch_shards, config.grad_accum_steps)
    eval_batch_size = config.eval_batch_size or config.global_batch_size
    check_eval_batch_size(eval_batch_size, batch_shards)

    # ------------------------------------------- data (a missing or bad dataset leaves no workdir)
    data_options = data.DataOptions.from_config(config.data)
    splits = data.open_dataset(dataset, data_options)
    sample_batch = factory.sample_batch(config, dataset, splits)
    check_model_fits(trainer.task, sample_batch, config.model, config.dataset)
    trainer.check_layout(sample_batch, config.global_batch_size)
    # Each process reads only its block of every global batch (see jddp/data/loader.py):
    # block `part` of `parts`; pipeline stages on other hosts read the same block.
    part, parts = trainer.batch_part
    processes = {"process_index": part, "process_count": parts}
    batches = data.train_batches(
        splits.train,
        splits.transform,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        threads=data_options.threads,
        workers=data_options.workers,
        **processes,
    )
    start = resume.check_before_start(workdir, config, trainer, sample_batch, batches)
    runtime.barrier("checks done")  # no process writes before every process has looked

    # ------------------------------- workdir, and the state: resumed, init_from, or fresh
    prepare_workdir(workdir)
    is_writer = jax.process_index() == 0
    logging.info("workdir: %s", os.path.abspath(workdir))
    checkpoints = None
    if config.checkpoint_every > 0:
        checkpoints = Checkpoints(
            os.path.join(workdir, "checkpoints"),
            every=config.checkpoint_every,
            max_to_keep=config.max_to_keep,
        )
    # A resume that fails (every checkpoint damaged, or not readable now) stops here: the only
    # writes so far set damaged checkpoints aside.
    try:
        start_step, state, data_state = resume.restore_or_start(
            trainer, config, checkpoints, sample_batch
        )
    except BaseException:
        if checkpoints is not None:
            checkpoints.close()
        raise
    finished = _finished_summary(workdir, config, start_step)
    if finished is not None:
        if checkpoints is not None:
            checkpoints.close()
        return finished
    if is_writer:
        write_config(workdir, config)
    placed = data.prefetch_to_device(batches, trainer.place_batch, data_options.device_prefetch)
    if data_state is not None:  # the saved order goes on, or (a change allowed) this config's
        resumed = data_state if start.data_order_continues else {**batches.get_state()}
        placed.set_state({**resumed, "step": data_state["step"]})

    def eval_pass():
        return data.eval_batches(
            splits.eval,
            splits.transform,
            batch_size=eval_batch_size,
            threads=data_options.threads,
            **processes,
        )

    runtime.check_same_everywhere(
        "config, seed and initial parameters", [config.to_json_best_effort(), _checksum(state)]
    )
    logging.info(
        "%s on %s: %d parameters, strategy %s on %d devices (mesh %s), global batch %d (%d per "
        "batch slice x %d accumulation steps)",
        config.model,
        config.dataset,
        sum(x.size for x in jax.tree.leaves(state.params)),
        trainer.strategy.name,
        num_devices,
        ",".join(f"{a}:{n}" for a, n in trainer.strategy.mesh.shape.items()),
        config.global_batch_size,
        config.global_batch_size // (batch_shards * config.grad_accum_steps),
        config.grad_accum_steps,
    )
    throughput = _throughput(config, trainer, objective, sample_batch)
    memory = {}
    if start_step < config.num_train_steps:
        memory = trainer.memory_report(state, _zeros_like_rows(sample_batch, config, trainer))
        logging.info(
            "per device: state (parameters + optimizer state) %s, compiled step peak %s, "
            "collectives %s per step",
            format_bytes(memory["state_bytes_per_device"]),
            format_bytes(memory["peak_bytes_per_device"]),
            format_bytes(memory["comm_bytes_per_step"]),
        )
        pipeline = trainer.strategy.pipeline if trainer.device_mesh else None
        if pipeline:
            memory |= pipeline.describe()
            logging.info(
                "pipeline: %s over %d stages, %d micro-batches, bubble (S-1)/(M+S-1) = %.1f%%",
                pipeline.schedule.name,
                pipeline.schedule.stages,
                pipeline.schedule.microbatches,
                100 * memory["pipeline_bubble"],
            )

    # ----------------------------------------------------------------------------- loop
    writer = MetricsWriter(workdir, start_step=start_step, enabled=is_writer)
    progress = Progress(config.num_train_steps, first_step=start_step, enabled=is_writer)
    preemption = PreemptionWatch()
    profiler = StepProfiler(
        os.path.join(workdir, "profile"), config.profile_start_step, config.profile_num_steps
    )
    watchdog = HangWatchdog.start(config.hang_timeout_s, workdir)
    eval_metrics: dict[str, float] = {}
    changes = {"config_changes": start.config_changes} if start.config_changes else {}
    preempted_at = None
    last_log_step, last_log_time = start_step, time.perf_counter()
    try:
        for step in range(start_step + 1, config.num_train_steps + 1):
            with profiler.step(step):
                state, metrics = trainer.step(state, next(placed))
            watchdog.dispatched(step, metrics["loss"])
            profiler.after(step, metrics["loss"])
            if step == start_step + 1:  # compilation: time the steady state from here
                metrics["loss"].block_until_ready()
                last_log_time = time.perf_counter()
            is_last = step == config.num_train_steps
            evaluate = step % config.eval_every == 0 or is_last
            if step % config.log_every == 0 or evaluate:
                record = {name: float(value) for name, value in jax.device_get(metrics).items()}
                record["nonfinite_steps"] = _nonfinite_steps(state, config, step)
                now = time.perf_counter()
                record["learning_rate"] = float(schedule(step - 1))  # the rate this step applied
                # The first step's rates include compiling; later ones are since the last record.
                since = last_log_time if step > start_step + 1 else start_time
                record.update(throughput.rates(step - last_log_step, now - since))
                if evaluate:
                    with watchdog.paused(f"evaluation at step {step}"):
                        eval_metrics = _evaluate(trainer, state, eval_pass(), objective)
                    record.update({f"eval_{k}": v for k, v in eval_metrics.items() if k != "count"})
                writer.write(step, record | memory | changes)
                memory = changes = {}
                progress.update(step, record["loss"], record)
                last_log_step, last_log_time = step, time.perf_counter()
            preempted = preemption.reached(step)
            if checkpoints is not None:
                checkpoints.check()  # a save that failed to write stops the run here
            if checkpoints is not None and (checkpoints.due(step) or preempted or is_last):
                _nonfinite_steps(state, config, step)  # never save a state holding NaN
                meta = resume.checkpoint_meta(config, trainer, step, placed.get_state())
                with watchdog.paused(f"checkpoint save at step {step}"):
                    state = trainer.consolidate(state)  # continue from what is saved
                    checkpoints.save(step, trainer.global_state(state), meta, force=True)
            if preempted:
                preempted_at = step
                logging.warning(
                    "preempted: saved a checkpoint at step %d and stopping; run the same command "
                    "to resume",
                    step,
                )
                break
    finally:
        watchdog.close()
        batches.close()
        profiler.stop()
        preemption.close()
        progress.close()
        writer.close()
        if checkpoints is not None:
            checkpoints.wait()  # a started save is a good one: let it commit
            checkpoints.close()

    # ------------------------------------------------------------------ export & summary
    if preempted_at is not None:
        return {
            "preempted": True,
            "step": preempted_at,
            "wall_time_sec": time.perf_counter() - start_time,
        }
    if not eval_metrics:  # resumed at the last step, before its export
        eval_metrics = _evaluate(trainer, state, eval_pass(), objective)
    checkpoint.export_params(os.path.join(workdir, "export"), trainer.host_state(state).params)
    summary = {f"eval_{k}": v for k, v in eval_metrics.items() if k != "count"}
    summary["wall_time_sec"] = time.perf_counter() - start_time
    if is_writer:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump({"step": config.num_train_steps, **summary}, f, indent=2)
    return summary


def _finished_summary(workdir: str, config, start_step: int) -> dict | None:
    """The saved summary of a run that already reached `num_train_steps` and was exported
    (running it again changes nothing), else None."""
    path = os.path.join(workdir, "summary.json")
    exported = os.path.isdir(os.path.join(workdir, "export"))
    if start_step < config.num_train_steps or not (exported and os.path.exists(path)):
        return None
    logging.info("%s already finished at step %d; nothing to do", workdir, start_step)
    with open(path) as f:
        summary = json.load(f)
    summary.pop("step", None)
    return summary


def _nonfinite_steps(state, config, step: int) -> int:
    """The count of non-finite steps so far; under `nan_policy=halt` any is the end."""
    count = int(state.nonfinite_steps)
    if count and config.nan_policy == "halt":
        raise TrainingHalted(
            f"loss or gradients became non-finite by step {step}; stopped without saving it, "
            "the checkpoints already in the workdir are untouched; lower the learning rate, set "
            "grad_clip_norm, or set nan_policy=skip to drop such updates"
        )
    return count


def _checksum(state) -> float:
    """Sum of the replicated leaves of `state` as this process sees them (under ddp: all)."""
    return float(
        sum(
            np.sum(np.asarray(x.addressable_shards[0].data), dtype=np.float64)
            for x in jax.tree.leaves(state)
            if x.sharding.is_fully_replicated
        )
    )


def _zeros_like_rows(sample_batch, config, trainer) -> dict:
    """Zeros shaped like this process's rows of a global batch: the step compiled for its report."""
    rows = config.global_batch_size // trainer.batch_part[1]
    return {
        k: np.zeros((rows, *np.shape(v)[1:]), np.asarray(v).dtype) for k, v in sample_batch.items()
    }


def _evaluate(trainer, state, batches, objective) -> dict[str, float]:
    """Eval means over the whole split, plus the objective's derived metrics (perplexity)."""
    eval_metrics = trainer.evaluate(state, batches)
    return eval_metrics | objective.eval_extras(eval_metrics)


def _throughput(config, trainer, objective, sample_batch) -> Throughput:
    """Speed reporting: model FLOPs of one global step (jddp/observe/flops.py) and the device's
    peak."""
    inputs = np.asarray(sample_batch[trainer.task.input_key])
    global_inputs = jax.ShapeDtypeStruct(
        (config.global_batch_size, *inputs.shape[1:]), inputs.dtype
    )
    step_flops = flops.train_step_flops(trainer.task.model, global_inputs)
    peak, peak_source = device_peak.peak_flops_per_device(
        jax.local_devices()[0], config.compute_dtype, config.peak_flops_per_device
    )
    logging.info(
        "model FLOPs per step: %s; peak FLOP/s per device: %s (%s)",
        f"{step_flops.per_step:.4g} ({step_flops.method})" if step_flops else "unknown",
        f"{peak:.4g}" if peak else "unknown",
        peak_source,
    )
    return Throughput(
        examples_per_step=config.global_batch_size,
        num_devices=jax.device_count(),
        tokens_per_example=objective.tokens_per_example(sample_batch),
        flops_per_step=step_flops.per_step if step_flops else None,
        peak_flops_per_device=peak,
    )
