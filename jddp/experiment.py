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
from jddp.errors import WorkdirError
from jddp.memory import format_bytes
from jddp.metrics_writer import MetricsWriter
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


def build_trainer(config, dataset, schedule, *, strategy=None, mesh=None) -> Trainer:
    """The Trainer a config describes; `strategy` and `mesh` override `parallel.*`."""
    strategy = strategy or config.parallel.strategy
    if mesh is None and strategy == config.parallel.strategy:
        mesh = config.parallel.mesh or None
    return Trainer(
        models.create_model(config.model, dataset.num_classes, **config.model_args),
        losses.softmax_cross_entropy,
        optim.create_optimizer(config, schedule),
        metrics={"accuracy": losses.accuracy},
        strategy=strategy,
        mesh=mesh,
        rules=config.parallel.rules if strategy != "ddp" else (),
        min_shard_size=config.parallel.min_shard_size,
        grad_accum_steps=config.grad_accum_steps,
        compute_dtype=config.compute_dtype,
        log_grad_norm=config.log_grad_norm,
    )


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Trains `config` into `workdir`; returns the final eval metrics and the wall time."""
    start_time = time.perf_counter()
    # ---------------------------------------- checks, model, trainer (nothing written yet)
    config_lib.validate(config)
    dataset = data.get_dataset(config.dataset)
    schedule = optim.learning_rate_schedule(config)
    trainer = build_trainer(config, dataset, schedule)
    num_devices = trainer.num_devices
    check_divisible(config.global_batch_size, num_devices, config.grad_accum_steps)
    eval_batch_size = config.eval_batch_size or config.global_batch_size
    check_divisible(eval_batch_size, num_devices, 1)
    trainer.check_layout(jax.ShapeDtypeStruct((1, *dataset.image_shape), np.float32))

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
        sum(x.size for x in jax.tree.leaves(state.params)),
        config.parallel.strategy,
        num_devices,
        config.global_batch_size,
        config.global_batch_size // (num_devices * config.grad_accum_steps),
        config.grad_accum_steps,
    )
    memory = trainer.memory_report(state, first_batch)  # goes into the first record too
    logging.info(
        "per device: state (parameters + optimizer state) %s, compiled step peak %s",
        format_bytes(memory["state_bytes_per_device"]),
        format_bytes(memory["peak_bytes_per_device"]),
    )

    # ----------------------------------------------------------------------------- loop
    writer = MetricsWriter(workdir, enabled=is_writer)
    progress = Progress(config.num_train_steps, enabled=is_writer)
    placed = data.prefetch_to_device(_chain(first_batch, batches), trainer.place_batch)
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
        writer.write(step, record | memory)
        memory = {}
        progress.update(step, record["loss"], record["examples_per_sec"])
        last_log_step, last_log_time = step, time.perf_counter()

    # -------------------------------------------------------------------------- summary
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


def _chain(first, rest):
    yield first
    yield from rest
