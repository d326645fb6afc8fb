"""`train_and_evaluate(config, workdir)`: one experiment config trained from start to end.

Read top to bottom: workdir, data, model and optimizer, the loop, the summary.
"""

import json
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from jddp import config as config_lib
from jddp import data, device_peak, flops, models, objectives, optim, strategies
from jddp.core import check_divisible
from jddp.errors import WorkdirError
from jddp.metrics_writer import MetricsWriter
from jddp.profiling import StepProfiler
from jddp.progress import Progress
from jddp.throughput import Throughput
from jddp.trainer import Trainer


def prepare_workdir(workdir: str) -> None:
    """Creates `workdir`, refusing a file or a directory that already holds a run."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"workdir {workdir!r} is a file; pass a directory path to --workdir")
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        raise WorkdirError(
            f"workdir {workdir!r} already holds a run (metrics.jsonl); pass a new --workdir"
        )
    os.makedirs(workdir, exist_ok=True)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Trains `config` into `workdir`; returns the final eval metrics and the wall time."""
    start_time = time.perf_counter()
    # ---------------------------------------- checks, model, trainer (nothing written yet)
    config_lib.validate(config)
    num_devices = jax.local_device_count()
    check_divisible(config.global_batch_size, num_devices, config.grad_accum_steps)
    eval_batch_size = config.eval_batch_size or config.global_batch_size
    check_divisible(eval_batch_size, num_devices, 1)
    dataset = data.get_dataset(config.dataset)
    objective, num_outputs = objectives.dataset_task(dataset)
    model = models.create_model(
        config.model,
        num_outputs,
        batch_axis_name=strategies.batch_axis_name(config.parallel.strategy),
        **config.model_args,
    )
    schedule = optim.learning_rate_schedule(config)
    trainer = Trainer(
        model,
        objective.loss_fn,
        optim.create_optimizer(config, schedule),
        metrics=dict(objective.metrics),
        input_key=objective.input_key,
        strategy=config.parallel.strategy,
        grad_accum_steps=config.grad_accum_steps,
        compute_dtype=config.compute_dtype,
        log_grad_norm=config.log_grad_norm,
    )

    # -------------------------------------------------------------------------- workdir
    prepare_workdir(workdir)
    is_writer = jax.process_index() == 0
    logging.info("workdir: %s", os.path.abspath(workdir))
    if is_writer:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")

    # ----------------------------------------------------------------------------- data
    train_source, eval_source = data.open_splits(
        dataset, config.data.data_dir or None, config.data.cache_max_mb
    )
    batches = data.train_batches(
        train_source,
        dataset.preprocess,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        threads=config.data.threads,
    )

    def eval_pass():
        return data.eval_batches(
            eval_source, dataset.preprocess, batch_size=eval_batch_size, threads=config.data.threads
        )

    # ---------------------------------------------------------------------------- state
    first_batch = next(batches)
    state = trainer.init(config.seed, first_batch)
    logging.info(
        "%s on %s: %d parameters, strategy %s on %d devices, global batch %d (%d per device x %d "
        "accumulation steps)",
        config.model,
        config.dataset,
        sum(np.size(x) for x in jax.tree.leaves(trainer.host_state(state).params)),
        config.parallel.strategy,
        num_devices,
        config.global_batch_size,
        config.global_batch_size // (num_devices * config.grad_accum_steps),
        config.grad_accum_steps,
    )
    throughput = _throughput(config, model, objective, first_batch)

    # ----------------------------------------------------------------------------- loop
    writer = MetricsWriter(workdir, enabled=is_writer)
    progress = Progress(config.num_train_steps, enabled=is_writer)
    profiler = StepProfiler(
        os.path.join(workdir, "profile"), config.profile_start_step, config.profile_num_steps
    )
    placed = data.prefetch_to_device(_chain(first_batch, batches), trainer.place_batch)
    eval_metrics: dict[str, float] = {}
    last_log_step, last_log_time = 0, time.perf_counter()
    for step in range(1, config.num_train_steps + 1):
        with profiler.step(step):
            state, metrics = trainer.step(state, next(placed))
        profiler.after(step, metrics["loss"])
        if step == 1:  # compilation: time the steady state from here
            metrics["loss"].block_until_ready()
            last_log_time = time.perf_counter()
        is_last = step == config.num_train_steps
        evaluate = step % config.eval_every == 0 or is_last
        if not (step % config.log_every == 0 or evaluate):
            continue
        record = {name: float(value) for name, value in jax.device_get(metrics).items()}
        now = time.perf_counter()
        record["learning_rate"] = float(schedule(step - 1))  # the rate this step applied
        # Step 1's rate includes compilation; later rates are since the previous record.
        since = last_log_time if step > 1 else start_time
        record.update(throughput.rates(step - last_log_step, now - since))
        if evaluate:
            eval_metrics = trainer.evaluate(state, eval_pass())
            eval_metrics.update(objective.eval_extras(eval_metrics))
            record.update({f"eval_{k}": v for k, v in eval_metrics.items() if k != "count"})
        writer.write(step, record)
        progress.update(step, record["loss"], record)
        last_log_step, last_log_time = step, time.perf_counter()

    # -------------------------------------------------------------------------- summary
    profiler.stop()
    progress.close()
    writer.close()
    wall_time = time.perf_counter() - start_time
    summary = {f"eval_{k}": v for k, v in eval_metrics.items() if k != "count"}
    summary["wall_time_sec"] = wall_time
    if is_writer:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump({"step": config.num_train_steps, **summary}, f, indent=2)
    return summary


def _throughput(config, model, objective, first_batch) -> Throughput:
    """Speed reporting: model FLOPs of one global step (jddp/flops.py) and the device's peak."""
    inputs = first_batch[objective.input_key]
    global_inputs = jax.ShapeDtypeStruct(
        (config.global_batch_size, *inputs.shape[1:]), inputs.dtype
    )
    step_flops = flops.train_step_flops(model, global_inputs)
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
        tokens_per_example=objective.tokens_per_example(first_batch),
        flops_per_step=step_flops.per_step if step_flops else None,
        peak_flops_per_device=peak,
    )


def _chain(first, rest):
    yield first
    yield from rest
