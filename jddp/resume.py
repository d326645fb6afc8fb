"""Where a run starts: the newest complete checkpoint of its workdir (resume), another run's
parameters (`init_from`), or a fresh initialization from the seed."""

import json
import os

import jax
from absl import logging

from jddp import checkpoint
from jddp.errors import CheckpointError, WorkdirError

# Config keys that define the model a checkpoint belongs to.
MODEL_KEYS = ("model", "model_args", "dataset")


def _resolved(config) -> dict:
    return json.loads(config.to_json_best_effort())


def check_before_start(workdir: str, config, trainer, sample_batch) -> None:
    """Refuses, before anything is written, a workdir whose checkpoints are of another model and
    an `init_from` that is missing or of another model (reads metadata only)."""
    found = checkpoint.peek_latest(os.path.join(workdir, "checkpoints"))
    if found is not None and config.checkpoint_every > 0:
        _check_resumable(*found, config, trainer.abstract_state(sample_batch), workdir)
    if config.init_from:
        if not os.path.exists(config.init_from):
            raise CheckpointError(
                f"init_from {config.init_from!r} does not exist; point it at a workdir, a "
                "workdir/checkpoints/STEP directory or a workdir/export directory"
            )
        params = trainer.abstract_state(sample_batch).params
        _check_params(checkpoint.param_shapes(config.init_from), params, config.init_from)


def _check_resumable(meta, saved_shapes, config, abstract_state, workdir) -> None:
    _check_same_model(meta, config, workdir)
    mismatch = checkpoint.first_mismatch(
        checkpoint.shapes_by_path(abstract_state), saved_shapes, f"the checkpoints of {workdir}"
    )
    if mismatch:
        raise CheckpointError(
            f"{mismatch}; these checkpoints belong to another model: pass a new --workdir"
        )


def _check_params(shapes, params, path) -> None:
    mismatch = checkpoint.first_mismatch(
        checkpoint.shapes_by_path(params), shapes, f"init_from {path!r}"
    )
    if mismatch:
        raise CheckpointError(f"{mismatch}; point init_from at a run of the same model")


def restore_or_start(trainer, config, checkpoints, sample_batch):
    """(start step, state, data iterator state or None) for this run."""
    if checkpoints is not None and checkpoints.steps():
        abstract = trainer.abstract_state(sample_batch)

        def check(meta, saved_shapes):
            _check_resumable(meta, saved_shapes, config, abstract, checkpoints.directory)

        restored = checkpoints.restore_latest(abstract, check)
        if restored is not None:
            step, state, meta = restored
            logging.info(
                "resuming from the checkpoint at step %d in %s", step, checkpoints.directory
            )
            return step, state, meta.get("data")
        logging.warning(
            "no checkpoint in %s could be restored: starting afresh", checkpoints.directory
        )
    state = trainer.init(config.seed, sample_batch)
    if config.init_from:
        state = _init_from(trainer, state, config, sample_batch)
    return 0, state, None


def _check_same_model(meta: dict, config, directory: str) -> None:
    saved, current = meta.get("config", {}), _resolved(config)
    for key in MODEL_KEYS:
        if saved.get(key) != current.get(key) and not config.allow_config_change:
            raise WorkdirError(
                f"the checkpoints in {directory} are of another model ({key}: "
                f"{saved.get(key)!r}, this config: {current.get(key)!r}); pass a new --workdir, "
                "or --config.allow_config_change=true to resume them anyway"
            )


def _init_from(trainer, state, config, sample_batch):
    """`state` with the parameters (and with `init_from_optimizer`, the optimizer state) of the
    run at `config.init_from`; the step, RNG and data order stay this run's own."""
    params = checkpoint.load_params(config.init_from)
    _check_params(checkpoint.shapes_by_path(params), state.params, config.init_from)
    state = trainer.replace_params(state, params)
    if config.init_from_optimizer:
        loaded = checkpoint.load_state(config.init_from, trainer.abstract_state(sample_batch))
        state = state.replace(opt_state=loaded.opt_state, model_state=loaded.model_state)
    logging.info(
        "initialized from %s%s",
        config.init_from,
        " (parameters and optimizer state)" if config.init_from_optimizer else "",
    )
    return state


def checkpoint_meta(config, trainer, step: int, data_state) -> dict:
    """What a checkpoint records besides the state: enough to know what wrote it."""
    from jddp import __version__

    return {
        "step": step,
        "jddp_version": __version__,
        "config": _resolved(config),
        "strategy": trainer.strategy.name,
        "mesh": {name: int(size) for name, size in trainer.strategy.mesh.shape.items()},
        "devices": trainer.num_devices,
        "processes": jax.process_count(),
        "data": data_state,
    }
