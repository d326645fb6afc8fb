"""Checkpoints with orbax: asynchronous saves with atomic commits, restore into any strategy's
shardings, a fallback past a damaged latest checkpoint, and a strategy-independent export.

A checkpoint directory `WORKDIR/checkpoints/STEP/` holds two items: `state` (the whole
`TrainState`: parameters, optimizer state, mutable collections, RNG key, step, non-finite count)
and `meta` (JSON: the resolved config, strategy, mesh, device and process counts, jddp version,
and the data iterator's state). The state is saved as global arrays, so restoring into another
strategy or device count is restoring into other shardings: orbax reshards on load.
"""

import datetime
import json
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from jddp.errors import CheckpointError
from jddp.quiet import library_warnings_muted
from jddp.sharding.rules import path_str

STATE, META = "state", "meta"


class Checkpoints:
    """The checkpoints of one workdir: `save` every `every` steps (and when JAX reports a
    preemption across processes), keeping the newest `max_to_keep`."""

    def __init__(self, directory: str, *, every: int, max_to_keep: int):
        self.directory = os.path.abspath(directory)
        # Every process must find the directory in the same state, or orbax's processes take
        # different paths (one creates it, the others do not) and its barriers mismatch.
        os.makedirs(self.directory, exist_ok=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jddp: checkpoints in {self.directory}")
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy(
                [policies.FixedIntervalPolicy(every), policies.PreemptionCheckpointingPolicy()]
            ),
            preservation_policy=policies.LatestN(max_to_keep),
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,  # a save cut short never counts as a checkpoint
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                STATE: ocp.StandardCheckpointHandler(),
                META: ocp.JsonCheckpointHandler(),
            },
        )

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def due(self, step: int) -> bool:
        """Whether `step` is a checkpoint step (by interval, or a preemption across processes)."""
        return self._manager.should_save(step)

    def save(self, step: int, state, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Starts an asynchronous save if `step` is due (or `force`); returns whether it did."""
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
            ),
            force=force,
        )

    def restore_latest(self, abstract_state, check=None):
        """(step, state, meta) of the newest checkpoint that restores, or None if there is none.

        `abstract_state` carries the target shardings (ShapeDtypeStructs or arrays). Before the
        state is read, `check(meta, saved_shapes)` may refuse the checkpoint by raising (a
        different model is not damage). A checkpoint that cannot be read is named in a warning
        and moved to `checkpoints_damaged/` beside the checkpoints (never deleted); the one
        before it is tried next.
        """
        for step in sorted(self.steps(), reverse=True):
            try:
                meta = self._manager.restore(
                    step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
                )[META]
                saved_shapes = shapes_by_path(self._manager.item_metadata(step)[STATE].tree)
            except Exception as e:  # any failure to read means "damaged"
                self._report_damage(step, e)
                continue
            if check is not None:
                check(meta, saved_shapes)
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        **{
                            STATE: ocp.args.StandardRestore(abstract_state),
                            META: ocp.args.JsonRestore(),
                        }
                    ),
                )
            except Exception as e:  # any failure to read means "damaged"
                self._report_damage(step, e)
                continue
            return step, restored[STATE], meta
        return None

    def _report_damage(self, step: int, error: Exception) -> None:
        source = os.path.join(self.directory, str(step))
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        target = os.path.join(
            os.path.dirname(self.directory), "checkpoints_damaged", f"{step}-{stamp}"
        )
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.move(source, target)
        self._manager.reload()
        message = str(error).splitlines()[0][:200] if str(error) else ""
        logging.warning(
            "checkpoint %s is damaged (%s: %s); moved it to %s and trying the one before",
            source,
            type(error).__name__,
            message,
            target,
        )

    def wait(self) -> None:
        """Blocks until every started save has committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def shapes_by_path(tree) -> dict[str, tuple[int, ...]]:
    """{"params/hidden_0/kernel": (64, 256), ...} for any tree of arrays or array metadata."""
    return {
        path_str(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def first_mismatch(expected: dict, actual: dict, source: str) -> str | None:
    """The first parameter whose path or shape differs between two `shapes_by_path` dicts."""
    for path, shape in expected.items():
        if path not in actual:
            return f"{source} has no parameter {path!r} (the model's has shape {shape})"
        if actual[path] != shape:
            return (
                f"parameter {path!r} has shape {actual[path]} in {source} but {shape} in the model"
            )
    for path, shape in actual.items():
        if path not in expected:
            return f"{source} has a parameter {path!r} of shape {shape} that the model lacks"
    return None


def peek_latest(directory: str):
    """(meta, shapes by path) of the newest readable checkpoint under `directory`, or None.

    Reads metadata files only, changes nothing, and takes no part in orbax's cross-process
    barriers (processes may call it while the directory changes under them); damaged
    checkpoints are skipped here and reported by `Checkpoints.restore_latest`."""
    if not os.path.isdir(directory):
        return None
    steps = [int(name) for name in os.listdir(directory) if name.isdigit()]
    for step in sorted(steps, reverse=True):
        folder = os.path.join(directory, str(step))
        try:
            with open(os.path.join(folder, META, "metadata")) as f:
                meta = json.load(f)
            return meta, shapes_by_path(_saved_tree(os.path.join(folder, STATE)))
        except Exception:  # unreadable or uncommitted: skip it here
            continue
    return None


def _saved_tree(directory: str):
    """The array metadata tree of one saved item. Orbax warns when an item is read outside its
    step directory's manager (no step-level `_CHECKPOINT_METADATA` beside it); for a read-only
    peek that is expected, so its warnings are muted here."""
    with library_warnings_muted("orbax"):
        return ocp.StandardCheckpointer().metadata(directory).item_metadata.tree


def param_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Shapes of the parameters `load_params(path)` would load, read from metadata only."""
    path = os.path.abspath(path)
    for candidate in _state_dirs(path):
        shapes = shapes_by_path(_saved_tree(candidate))
        if candidate.endswith(STATE):
            return {k[len("params/") :]: v for k, v in shapes.items() if k.startswith("params/")}
        return shapes
    raise CheckpointError(
        f"init_from {path!r} holds no parameters; point it at a workdir, a "
        "workdir/checkpoints/STEP directory or a workdir/export directory"
    )


# ------------------------------------------------------------------------------- export
def export_params(directory: str, params) -> None:
    """Saves `params` as host numpy arrays: an inference checkpoint no strategy is needed for."""
    host = jax.tree.map(np.asarray, params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(directory), host, force=True)


def _state_dirs(path: str) -> list[str]:
    """Directories under `path` that may hold a saved tree, most specific first."""
    checkpoints = os.path.join(path, "checkpoints")
    candidates = [os.path.join(path, "export")]
    if os.path.isdir(checkpoints):
        steps = sorted((int(s) for s in os.listdir(checkpoints) if s.isdigit()), reverse=True)
        candidates += [os.path.join(checkpoints, str(step), STATE) for step in steps]
    candidates += [os.path.join(path, STATE), path]
    return [c for c in candidates if os.path.exists(os.path.join(c, "_METADATA"))]


def load_params(path: str):
    """Parameters as host numpy arrays from an export dir, a `checkpoints/STEP` dir, or a
    workdir (its export, else its newest checkpoint)."""
    path = os.path.abspath(path)
    for candidate in _state_dirs(path):
        tree = ocp.StandardCheckpointer().restore(candidate)
        is_state = candidate.endswith(STATE)
        return jax.tree.map(np.asarray, tree["params"] if is_state else tree)
    raise CheckpointError(
        f"init_from {path!r} holds no parameters; point it at a workdir, a "
        "workdir/checkpoints/STEP directory or a workdir/export directory"
    )


def load_state(path: str, abstract_state):
    """A whole TrainState from a workdir (newest checkpoint) or `checkpoints/STEP` dir, restored
    into `abstract_state`'s shardings."""
    path = os.path.abspath(path)
    for candidate in _state_dirs(path):
        if candidate.endswith(STATE):
            return ocp.StandardCheckpointer().restore(candidate, abstract_state)
    raise CheckpointError(
        f"init_from {path!r} holds no optimizer state (an export has parameters only); point it "
        "at a workdir or workdir/checkpoints/STEP, or set init_from_optimizer=false"
    )
