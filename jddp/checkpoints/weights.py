"""Weights to start a run from, found by name wherever they were saved: a jddp workdir (its
newest checkpoint, else its export), its `checkpoints/STEP` or `export` dir, a checkpoint a Flax
example wrote with `flax.training.checkpoints` (orbax dirs `checkpoint_N`, or msgpack files), or an
orbax `CheckpointManager` dir (`STEP/ITEM`). Parameters are the tree under `params`; BatchNorm
statistics the one under `batch_stats` (Flax) or `model_state` (jddp)."""

import dataclasses
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization

from jddp.checkpoints.compatibility import shapes_by_path
from jddp.checkpoints.damage import META, STATE
from jddp.checkpoints.folder import numbered
from jddp.checkpoints.peek import saved_tree
from jddp.checkpoints.read_verdicts import read_failure
from jddp.errors import CheckpointError
from jddp.runtime.quiet import library_warnings_muted


@dataclasses.dataclass(frozen=True)
class Weights:
    """Parameters and, if the checkpoint holds them, mutable collections (`{"batch_stats":
    ...}`) as host arrays; `source` is the saved tree they came from."""

    params: Any
    model_state: Any | None
    source: str


def _saved_trees(path: str) -> list[str]:
    """Saved trees under `path`, most specific first: `path` itself; a jddp workdir's newest
    checkpoint, then its export; a jddp `checkpoints/STEP` dir's state; an orbax
    CheckpointManager dir's newest `STEP/ITEM`; a `flax.training.checkpoints` dir's newest
    `checkpoint_N` (an orbax dir, or a msgpack file when Flax did not use orbax)."""
    candidates = [path]
    candidates += [
        os.path.join(step, STATE) for step in numbered(os.path.join(path, "checkpoints"))
    ]
    candidates += [os.path.join(path, "export"), os.path.join(path, STATE)]
    for step in numbered(path):
        candidates += [os.path.join(step, item) for item in sorted(os.listdir(step))]
    candidates += numbered(path, "checkpoint_")
    return [c for c in candidates if os.path.isfile(f"{c}/_METADATA") or _is_msgpack_file(c)]


def _is_msgpack_file(path: str) -> bool:
    return os.path.isfile(path) and re.fullmatch(r"checkpoint_\d+", os.path.basename(path))


def _is_jddp_state(saved: str) -> bool:
    return os.path.basename(saved) == STATE and os.path.isdir(os.path.join(saved, "..", META))


def _read(saved: str, *, arrays: bool):
    """The tree saved at `saved`: host numpy arrays, or with `arrays=False` only their metadata
    (a msgpack file has no separate metadata: it is read whole)."""
    if os.path.isfile(saved):
        with open(saved, "rb") as f:
            return serialization.msgpack_restore(f.read())
    try:
        metadata = saved_tree(saved)
        if not arrays:
            return metadata
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
        with library_warnings_muted("orbax"):
            return ocp.PyTreeCheckpointer().restore(
                saved, args=ocp.args.PyTreeRestore(restore_args=as_numpy)
            )
    except Exception as e:
        if not _is_jddp_state(saved):
            raise
        # a checkpoint of a run, perhaps a live one pruning it: one line, nothing moved
        raise read_failure(os.path.dirname(saved), e) from None


def _weights_in(tree):
    """(params, model_state or None) found by name: `params` (unwrapping a variables dict
    saved as params) and `batch_stats` (Flax examples) or `model_state` (jddp); a tree with no
    `params` key is parameters alone (a jddp export)."""
    if not isinstance(tree, dict) or "params" not in tree:
        return tree, None
    params = tree["params"]
    if isinstance(params, dict) and set(params) == {"params"}:
        params = params["params"]
    if tree.get("model_state"):
        return params, tree["model_state"]
    if "batch_stats" in tree:
        return params, {"batch_stats": tree["batch_stats"]}
    return params, None


def _first_saved(path: str) -> str:
    found = _saved_trees(os.path.abspath(path))
    if not found:
        raise CheckpointError(
            f"init_from {path!r} holds no saved weights; point it at a jddp workdir (or its "
            "checkpoints/STEP or export dir), or at a checkpoint directory written by orbax or "
            "flax.training.checkpoints"
        )
    return found[0]


def weight_shapes(path: str) -> tuple[dict, dict | None, str]:
    """(parameter shapes, mutable collection shapes or None, the saved tree) of what
    `load_weights(path)` would load, by path, from metadata alone where it can."""
    saved = _first_saved(path)
    params, model_state = _weights_in(_read(saved, arrays=False))
    model_shapes = shapes_by_path(model_state) if model_state is not None else None
    return shapes_by_path(params), model_shapes, saved


def load_weights(path: str) -> Weights:
    """The weights saved under `path` (see `_saved_trees` for where they are looked for)."""
    saved = _first_saved(path)
    params, model_state = _weights_in(_read(saved, arrays=True))
    return Weights(params, model_state, saved)


def load_params(path: str):
    """Parameters as host numpy arrays from anywhere `load_weights` looks."""
    return load_weights(path).params


def jddp_state_in(path: str) -> str | None:
    """The newest whole jddp TrainState saved under `path` (a workdir or `checkpoints/STEP`)."""
    return next((s for s in _saved_trees(os.path.abspath(path)) if _is_jddp_state(s)), None)


def state_shapes(path: str) -> dict[str, tuple]:
    """Shapes by path of the TrainState `load_state(path, ...)` would read (metadata only)."""
    saved = jddp_state_in(path)
    if saved is None:
        raise CheckpointError(f"init_from {path!r} holds no jddp TrainState")
    return shapes_by_path(_read(saved, arrays=False))


def load_state(path: str, abstract_state):
    """A whole TrainState from `jddp_state_in(path)`, restored into `abstract_state`'s
    shardings."""
    saved = jddp_state_in(path)
    if saved is None:
        raise CheckpointError(f"init_from {path!r} holds no jddp TrainState")
    return ocp.StandardCheckpointer().restore(saved, abstract_state)
