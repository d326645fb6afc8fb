"""`save` / `restore`: checkpoints for users who write their own loop, in the same orbax layout
`jddp.fit` writes (a `fit` workdir's checkpoints restore here, and the other way round)."""

import os
from collections.abc import Mapping

import jax
import numpy as np
from absl import logging

from jddp.checkpoints.compatibility import restore_layout
from jddp.checkpoints.store import Checkpoints
from jddp.core.state import TrainState
from jddp.errors import CheckpointError, UsageError, WorkdirError
from jddp.runtime.fs import directory_problem

Batch = Mapping[str, np.ndarray]


def _checkpoints_dir(directory: str) -> str:
    """A `fit` workdir's checkpoints folder, or `directory` itself."""
    inside = os.path.join(directory, "checkpoints")
    return inside if os.path.isdir(inside) else directory


def _check_step(step, caller: str) -> None:
    if step is not None and (not isinstance(step, int | np.integer) or step < 0):
        raise UsageError(f"jddp.{caller} got step={step!r}; pass a whole number >= 0, or None")


def save(directory: str, state: TrainState, *, step: int | None = None, trainer=None, meta=None):
    """Saves `state` as checkpoint `step` (default: `state.step`) under `directory` (a `fit`
    workdir: into its `checkpoints/`), waits until it is committed and returns its path. A step
    already saved there is left as it is. Pass the `trainer` that made `state` (its arrays are
    then gathered into global ones, as ddp needs); `meta` is JSON-able data saved beside it."""
    if not isinstance(state, TrainState):
        raise UsageError(
            f"jddp.save got {type(state).__name__}, not a TrainState; pass the state that "
            "trainer.init, trainer.step or jddp.fit returned"
        )
    _check_step(step, "save")
    step = int(jax.device_get(state.step)) if step is None else int(step)
    if trainer is not None:
        state = trainer.global_state(state)
    folder = _checkpoints_dir(directory)
    problem = directory_problem(folder, write=True)
    if problem:
        raise WorkdirError(f"checkpoint directory {folder!r} {problem}; pass one you can write")
    checkpoints = Checkpoints(folder, every=1, max_to_keep=None)
    try:
        if step in checkpoints.steps():
            logging.warning("%s already holds step %d; left as it is", checkpoints.directory, step)
        else:
            checkpoints.save(step, state, {"step": step, **(meta or {})}, force=True)
            checkpoints.wait()
    finally:
        checkpoints.close()
    return os.path.join(checkpoints.directory, str(step))


def restore(directory: str, trainer, sample_batch: Batch, *, step: int | None = None):
    """The state saved under `directory` (a `fit` workdir or a `save` directory): the newest
    checkpoint, or that of `step`, laid out as `trainer` lays its state out (any strategy, mesh
    or device count: the arrays are resharded on load). None when there is no checkpoint."""
    if not hasattr(trainer, "abstract_state"):
        raise UsageError(
            f"jddp.restore got {type(trainer).__name__} as its trainer; call "
            "jddp.restore(directory, trainer, sample_batch) with the Trainer whose state to restore"
        )
    _check_step(step, "restore")
    folder = _checkpoints_dir(directory)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder!r} is not a directory of checkpoints")
    abstract = trainer.abstract_state(sample_batch)
    checkpoints = Checkpoints(folder, read_only=True)  # beside a live run: it changes nothing
    try:
        found = checkpoints.restore_latest(abstract, layout=restore_layout, step=step)
    finally:
        checkpoints.close()
    return None if found is None else found[1]
