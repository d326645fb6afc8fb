"""From an experiment config to what a run trains with: its dataset, objective, model, trainer
and one sample batch. The CLI's loop and the planner both build from here, so they agree on the
model, the partition rules and the bytes of the compute dtype.

The mesh comes first: the model takes its axis names from it (big_vision's order).
"""

import os

import jax
import ml_collections
import numpy as np

from jddp import data, losses, models
from jddp.checkpoints import hf
from jddp.checkpoints.newest import NewestCheckpoint
from jddp.core.task import compute_dtype_of
from jddp.parallel import context, strategies
from jddp.parallel.mesh import DeviceMesh
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.rules import adapt_preset
from jddp.run import objectives, optim
from jddp.run.config import lora_of
from jddp.run.objectives import Objective
from jddp.trainer import Trainer


def with_checkpoint_model_args(
    config, newest: NewestCheckpoint | None = None
) -> ml_collections.ConfigDict:
    """`config` with `model_args` completed from `init_from="hf:DIR"`'s config.json (a copy;
    `config` itself when it starts from no Hugging Face checkpoint), so that the run's
    config.json and checkpoints record the whole model. A ConfigError names a model or an
    argument that contradicts the checkpoint. A run resuming `newest` (its workdir's newest
    checkpoint) after DIR has moved takes the arguments that checkpoint was written with."""
    if not hf.is_hf(config.init_from):
        return config
    given = config.model_args.to_dict()
    saved = newest.config if newest is not None else {}
    if saved.get("init_from") == config.init_from and not os.path.exists(
        hf.directory(config.init_from)
    ):
        args = {**(saved.get("model_args") or {}), **given}
    else:
        args = hf.resolved_model_args(config.model, given, config.init_from)
    config = ml_collections.ConfigDict(config.to_dict())
    config.model_args = ml_collections.ConfigDict(args)
    return config


def dataset_spec(config) -> data.DatasetSpec:
    """The dataset `config.dataset` names: a built-in one (nothing is read or prepared yet), or
    own data (its labels or text read, to count the classes or characters)."""
    return data.get_dataset(config.dataset, options=data.DataOptions.from_config(config.data))


def objective(dataset: data.DatasetSpec) -> Objective:
    """What the dataset's task asks of training: loss, metrics, eval extras."""
    return objectives.objective_for(dataset.kind, masked=dataset.loss_mask)


def compute_bytes(config) -> int:
    """Bytes of one activation element in `config.compute_dtype` (float16: 2, like bfloat16)."""
    return np.dtype(compute_dtype_of(config.compute_dtype)).itemsize


def create_model(config, dataset: data.DatasetSpec, device_mesh: DeviceMesh):
    """The config's model, with the axis names and sizes `device_mesh` gives it."""
    return models.create_model(
        config.model,
        dataset.num_classes,
        batch_axis_name=device_mesh.batch_axes,
        tensor_axis=device_mesh.tensor_axis,
        tensor_size=device_mesh.size("tensor"),
        sequence_parallel=config.parallel.sequence_parallel,
        context_axis=device_mesh.context_axis,
        context_attention=config.parallel.context_attention,
        expert_axis=device_mesh.expert_axis,
        pipelined=bool(device_mesh.stage_axis),
        seed=config.seed,  # an own NNX model initializes its parameters from it
        **config.model_args,
    )


def partition_rules(config, device_mesh: DeviceMesh, model) -> tuple:
    """The rules that lay `model`'s parameters out on `device_mesh`: the config's own, or, on a
    mesh with a tensor axis and none given, the model's preset fitted to the mesh."""
    # Pairs as tuples; anything else is left for the rules' own check to name (one pair
    # without its enclosing tuple, say, whose strings would otherwise be split into letters).
    rules = tuple(
        tuple(rule) if isinstance(rule, list | tuple) else rule for rule in config.parallel.rules
    )
    if device_mesh.tensor_axis and not rules:
        preset = models.tensor_rules(config.model, model, device_mesh.size("tensor"))
        rules = adapt_preset(preset, device_mesh)
    return rules


def mesh_for(config, *, strategy=None, mesh=None) -> DeviceMesh:
    """The mesh `config`'s strategy runs on (`strategy` and a `mesh` spec override the
    config's), over every device."""
    strategy = strategy or config.parallel.strategy
    if mesh is None and strategy == config.parallel.strategy:
        mesh = config.parallel.mesh or None
    return strategies.device_mesh_for(
        strategy,
        mesh,
        allow_cross_host_tensor=config.parallel.allow_cross_host_tensor,
        allow_cross_host_context=config.parallel.allow_cross_host_context,
    )


def batch_splits(config, device_mesh: DeviceMesh) -> int:
    """Into how many pieces one accumulation step's batch is split on `device_mesh`: its batch
    slices x the pipeline's micro-batches (known from `parallel.pipeline` before any trainer
    is built)."""
    pipeline = PipelineOptions(**config.parallel.pipeline)
    return device_mesh.batch_slices * pipeline.microbatches_per_step(device_mesh)


def build_trainer(
    config,
    dataset: data.DatasetSpec,
    schedule=None,
    *,
    strategy=None,
    mesh: str | DeviceMesh | None = None,
    grad_accum_steps=None,
) -> Trainer:
    """The Trainer a config describes for `dataset`'s task; `strategy`, `mesh` (a spec, or a
    `DeviceMesh` already built for `strategy`) and `grad_accum_steps` override the config's;
    `schedule` defaults to the config's learning-rate schedule."""
    strategy = strategy or config.parallel.strategy
    device_mesh = mesh
    if not isinstance(mesh, DeviceMesh):
        device_mesh = mesh_for(config, strategy=strategy, mesh=mesh)
    if device_mesh.context_axis and dataset.kind == data.LANGUAGE_MODEL:
        context.check_length(config.data.seq_len, device_mesh.size("context"))
    schedule = schedule or optim.learning_rate_schedule(config)
    task_objective = objective(dataset)
    model = create_model(config, dataset, device_mesh)
    return Trainer(
        model,
        task_objective.loss_fn,
        optim.create_optimizer(config, schedule),
        metrics=dict(task_objective.metrics),
        strategy=strategy,
        mesh=device_mesh,
        rules=partition_rules(config, device_mesh, model),
        min_shard_size=config.parallel.min_shard_size,
        pipeline=PipelineOptions(**config.parallel.pipeline),
        grad_accum_steps=grad_accum_steps or config.grad_accum_steps,
        compute_dtype=config.compute_dtype,
        log_grad_norm=config.log_grad_norm,
        skip_nonfinite=config.nan_policy == "skip",
        input_key=dataset.model_inputs,
        grad_comm_dtype=config.parallel.grad_comm_dtype,
        grad_compression=config.parallel.grad_compression,
        powersgd_rank=config.parallel.powersgd_rank,
        powersgd_start_step=config.parallel.powersgd_start_step,
        collectives=config.parallel.collectives,
        lora=lora_of(config),
    )


def sample_batch(config, dataset: data.DatasetSpec, splits=None) -> dict[str, np.ndarray]:
    """One example as a batch of 1, to shape the model: a language model's from the sequence
    length alone; other datasets' from `splits` (opened here, and prepared if need be, when not
    given)."""
    if dataset.kind == data.LANGUAGE_MODEL and splits is None:
        tokens = np.zeros((1, config.data.seq_len), np.int32)
        counted = {losses.LOSS_MASK: np.ones((1, config.data.seq_len), np.float32)}
        if dataset.packed:  # one document filling the row
            positions = np.arange(config.data.seq_len, dtype=np.int32)[None]
            counted |= {"segment_ids": np.ones_like(tokens), "positions": positions}
        return {"inputs": tokens, "targets": tokens, **(counted if dataset.loss_mask else {})}
    if splits is None:
        splits = data.open_dataset(dataset, data.DataOptions.from_config(config.data))
    return splits.sample_batch()


def global_batch_shapes(sample: dict, global_batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one global batch of `sample`'s entries."""
    return {
        name: jax.ShapeDtypeStruct((global_batch_size, *np.shape(x)[1:]), np.asarray(x).dtype)
        for name, x in sample.items()
    }
