"""Where `fit` starts: the newest checkpoint restored (or a given or fresh state), the data moved
past the batches already trained on, and the checks of the data made before anything is
written."""

import itertools
from collections.abc import Mapping

import jax
import numpy as np
from absl import logging

from jddp.checkpoints.compatibility import restore_layout
from jddp.errors import DataError
from jddp.version import __version__


def restore_or_start(trainer, checkpoints, sample_batch, seed, given, check, ledger):
    """(start step, state, the restored checkpoint's metadata or {}): the newest checkpoint of
    `checkpoints` that restores, else `given` (a state, or a function giving one), else a fresh
    state from `seed`."""
    if checkpoints is not None and checkpoints.steps():
        abstract = trainer.abstract_state(sample_batch)
        with ledger.timing("restore"):
            step, state, meta = checkpoints.restore_latest(
                abstract, check, restore_layout, fix="or pass a new workdir to train afresh"
            )
        return step, state, meta
    if given is None:
        return 0, trainer.init(seed, sample_batch), {}
    return 0, given() if callable(given) else given, {}


def first_batch(batches):
    """(the batches, the first of them): the first batch stays first, set back through
    `get_state` / `set_state` where the iterator has them, else chained back in front."""
    saved = batches.get_state() if hasattr(batches, "get_state") else None
    batch = next(batches, None)
    if batch is None:
        raise DataError("train_batches is empty; pass an iterable of batches (dicts of arrays)")
    if saved is not None and hasattr(batches, "set_state"):
        batches.set_state(saved)
        return batches, batch
    return itertools.chain([batch], batches), batch


def position(batches, start_step: int, data_state) -> None:
    """Moves `batches` past the `start_step` batches already trained on."""
    if not start_step:
        return
    if data_state is not None and hasattr(batches, "set_state"):
        batches.set_state(data_state)
        return
    for done in range(start_step):
        if next(batches, None) is None:
            raise DataError(
                f"train_batches ended after {done} batches, but the checkpoint being resumed "
                f"is at step {start_step}; pass the batches it was trained on"
            )


def check_train_batches(batches) -> None:
    """Where the iterator says how many examples it draws from (jddp.data.train_batches does,
    in its state): none is a DataError, and a global batch larger than that one warning (it
    trains, but each batch then repeats examples: not the batch size the run asked for)."""
    state = batches.get_state() if hasattr(batches, "get_state") else None
    if not isinstance(state, Mapping):
        return
    size, examples = state.get("global_batch_size"), state.get("num_examples")
    if not (isinstance(size, int) and isinstance(examples, int)):
        return
    if examples == 0:
        raise DataError("the training set has no examples; point the data at a non-empty split")
    if size > examples and jax.process_index() == 0:
        logging.warning(
            "global_batch_size=%d is larger than the training set (%d examples): every batch "
            "holds some examples more than once; use a global batch size of at most %d, or more "
            "data",
            size, examples, examples,
        )  # fmt: skip


def checkpoint_meta(trainer, step: int, data_state) -> dict:
    """What a checkpoint records besides the state: enough to know what wrote it."""
    return {
        "step": step,
        "jddp_version": __version__,
        "strategy": trainer.strategy.name,
        "mesh": {name: int(size) for name, size in trainer.strategy.mesh.shape.items()},
        "devices": trainer.num_devices,
        "processes": jax.process_count(),
        "data": data_state,
    }


def rows(batch) -> int:
    return int(np.shape(next(iter(jax.tree.leaves(batch))))[0])


def checksum(state) -> float:
    """Sum of the replicated leaves of `state` as this process sees them (under ddp: all)."""
    return float(
        sum(
            np.sum(np.asarray(x.addressable_shards[0].data), dtype=np.float64)
            for x in jax.tree.leaves(state)
            if x.sharding.is_fully_replicated
        )
    )
