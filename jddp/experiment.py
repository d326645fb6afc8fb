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
from jddp import data, losses, models, optim
from jddp.core import check_divisible
from jddp.errors import ConfigError, WorkdirError
from jddp.metrics_writer import MetricsWriter
from jddp.model_fit import check_model_fits
from jddp.progress import Progress
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
    dataset = data.get_dataset(config.dataset, config.data.get("text_file", ""))
    if dataset.kind != data.CLASSIFICATION:  # until the language-model task lands
        raise ConfigError(
            f"dataset {config.dataset!r} is for language models, which this "
            "experiment cannot train yet; choose a classification dataset"
        )
    model = models.create_model(config.model, dataset.num_classes, **config.model_args)
    schedule = optim.learning_rate_schedule(config)
    trainer = Trainer(
        model,
        losses.softmax_cross_entropy,
        optim.create_optimizer(config, schedule),
        metrics={"accuracy": losses.accuracy},
        strategy=config.parallel.strategy,
        grad_accum_steps=config.grad_accum_steps,
        compute_dtype=config.compute_dtype,
        log_grad_norm=config.log_grad_norm,
        input_key=dataset.input_key,
    )

    # ------------------------------------------- data (a missing or bad dataset leaves no workdir)
    data_options = data.DataOptions.from_config(config.data)
    splits = data.open_dataset(dataset, data_options)
    sample_batch = splits.sample_batch()
    check_model_fits(trainer.task, sample_batch, config.model, config.dataset)

    # -------------------------------------------------------------------------- workdir
    prepare_workdir(workdir)
    is_writer = jax.process_index() == 0
    logging.info("workdir: %s", os.path.abspath(workdir))
    if is_writer:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")

    # ------------------------------------------------------------------- input pipeline
    # Each process reads only its rows of every global batch (see jddp/data/pipeline.py).
    processes = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    batches = data.train_batches(
        splits.train,
        splits.transform,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        threads=data_options.threads,
        workers=data_options.workers,
        **processes,
    )

    def eval_pass():
        return data.eval_batches(
            splits.eval,
            splits.transform,
            batch_size=eval_batch_size,
            threads=data_options.threads,
            **processes,
        )

    # ---------------------------------------------------------------------------- state
    state = trainer.init(config.seed, sample_batch)
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

    # ----------------------------------------------------------------------------- loop
    writer = MetricsWriter(workdir, enabled=is_writer)
    progress = Progress(config.num_train_steps, enabled=is_writer)
    placed = data.prefetch_to_device(batches, trainer.place_batch, data_options.device_prefetch)
    eval_metrics: dict[str, float] = {}
    last_log_step, last_log_time = 0, time.perf_counter()
    for step in range(1, config.num_train_steps + 1):
        state, metrics = trainer.step(state, next(placed))
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
        record["examples_per_sec"] = (
            (step - last_log_step) * config.global_batch_size / max(now - last_log_time, 1e-9)
            if step > 1
            else config.global_batch_size / (now - start_time)
        )
        if evaluate:
            eval_metrics = trainer.evaluate(state, eval_pass())
            record.update({f"eval_{k}": v for k, v in eval_metrics.items() if k != "count"})
        writer.write(step, record)
        progress.update(step, record["loss"], record["examples_per_sec"])
        last_log_step, last_log_time = step, time.perf_counter()

    # -------------------------------------------------------------------------- summary
    batches.close()
    progress.close()
    writer.close()
    wall_time = time.perf_counter() - start_time
    summary = {
        "eval_accuracy": eval_metrics["accuracy"],
        "eval_loss": eval_metrics["loss"],
        "wall_time_sec": wall_time,
    }
    if is_writer:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump({"step": config.num_train_steps, **summary}, f, indent=2)
    return summary
