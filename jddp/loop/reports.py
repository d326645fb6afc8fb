"""What `fit` reports once, at its first step: the run's shape, the memory per device (state,
compiled step, collectives, the pipeline's and context parallelism's shape) and the FLOPs a step
does, for the speed records."""

import jax
import numpy as np
from absl import logging

from jddp.observe import device_peak, flops
from jddp.observe.memory import format_bytes
from jddp.observe.throughput import Throughput


def first_step_report(trainer, state, batch, sample_batch, global_batch_size, records):
    """(the memory report for the first record, the speed report): logs the run's shape, all
    known once the first batch is placed."""
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
    throughput = _throughput(
        trainer, sample_batch, global_batch_size, records.tokens_per_example,
        records.peak_flops_per_device,
    )  # fmt: skip
    return _memory_report(trainer, state, batch), throughput


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
    """Speed reporting: model FLOPs of one global step on the model's inputs, however the task
    routes them (one array, or a packed batch's tokens, segment ids and positions), by
    jddp/observe/flops.py; and the device's peak."""
    task = trainer.task
    global_inputs = {
        entry: jax.ShapeDtypeStruct((global_batch_size, *np.shape(x)[1:]), np.asarray(x).dtype)
        for entry, x in task.model_inputs(sample_batch).items()
    }
    args, kwargs = task.inputs.call_args(global_inputs)
    step_flops = flops.train_step_flops(task.model, *args, **kwargs)
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
