"""Checkpoints with orbax: asynchronous saves with atomic commits, restore into any strategy's
shardings, a fallback past a damaged latest checkpoint, and a strategy-independent export.

A checkpoint directory `WORKDIR/checkpoints/STEP/` holds two items: `state` (the whole
`TrainState`: parameters, optimizer state, mutable collections, RNG key, step, non-finite count)
and `meta` (JSON: the resolved config, strategy, mesh, device and process counts, jddp version,
and the data iterator's state). The state is saved as global arrays, so restoring into another
strategy or device count is restoring into other shardings: orbax reshards on load.

Whether a checkpoint's state fits the trainer's (another model is refused, never set aside as
damage): jddp/checkpoints/compatibility.py. Weights to start a run from, found in these and in other
programs' checkpoints: jddp/checkpoints/weights.py.
"""

import contextlib
import datetime
import gc
import json
import logging as std_logging
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from jddp.checkpoints.compatibility import check_state_matches, is_misfit
from jddp.core import layer_stacks
from jddp.core.tree_paths import path_str
from jddp.errors import CheckpointError, ShapeError, WorkdirError
from jddp.observe.memory import format_bytes
from jddp.runtime import quiet
from jddp.runtime.fs import is_damage, write_failure

STATE, META = "state", "meta"


class Checkpoints:
    """The checkpoints of one workdir: `save` every `every` steps (and when JAX reports a
    preemption across processes), keeping the newest `max_to_keep`.

    A save that fails to write (a full disk, a write error) raises CheckpointError, in one line
    naming the directory and the bytes it needs, from the call that finds out: `save`, `check`
    (cheap: call it every step) or `wait`. The checkpoints written before it stay as they were.

    From construction to `close()`, the failures it reports itself are kept off the console
    (`FAILURES_REPORTED`); `close()` gives the process back its hooks and filters.
    """

    def __init__(self, directory: str, *, every: int, max_to_keep: int | None):
        self.directory = os.path.abspath(directory)
        check_checkpoints_dir(self.directory)
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
            preservation_policy=policies.LatestN(max_to_keep) if max_to_keep else None,
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
        self._saving = None  # (step, bytes) of the save in flight
        self._failed = False
        self._read_failed = False
        FAILURES_REPORTED.acquire()
        self._quieting = True

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def due(self, step: int) -> bool:
        """Whether `step` is a checkpoint step (by interval, or a preemption across processes)."""
        return self._manager.should_save(step)

    def save(self, step: int, state, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Starts an asynchronous save if `step` is due (or `force`); returns whether it did.
        A step already saved is left as it is (one line in the log), not saved again."""
        if step in self._manager.all_steps():
            logging.info(
                "checkpoint of step %d already in %s; not saved again", step, self.directory
            )
            return False
        needed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        with self._write_failures(step, needed):  # orbax first waits for the previous save
            started = self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
                ),
                force=force,
            )
        if started:
            self._saving = (step, needed)
        return started

    def check(self) -> None:
        """Raises the failure of a save that has finished, if it failed; never waits."""
        if self._saving is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Blocks until every started save has committed (or one has failed: raised once)."""
        if self._failed:
            return
        with self._write_failures():
            self._manager.wait_until_finished()
        self._saving = None

    def close(self) -> None:
        try:
            if not self._failed:  # orbax would raise the reported failure again: just let go
                self._manager.close()
        finally:
            if self._quieting:
                if self._read_failed:
                    # asyncio reports the failed read's abandoned tasks when the garbage
                    # collector reaches them: now, while those reports are still dropped.
                    gc.collect()
                self._quieting = False
                FAILURES_REPORTED.release()

    @contextlib.contextmanager
    def _write_failures(self, step: int | None = None, needed: int = 0):
        """Turns a failed write (of the save in flight, else of `step`) into one line."""
        try:
            yield
        except Exception as e:
            reason = write_failure(e)
            if reason is None:
                raise
            self._failed = True
            if self._saving is not None:
                step, needed = self._saving
            free = shutil.disk_usage(self.directory).free
            saved = sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())
            kept = f"newest: step {saved[-1]}" if saved else "there are none yet"
            raise CheckpointError(
                f"could not save the checkpoint of step {step} in {self.directory}: {reason} "
                f"(it needs about {format_bytes(needed)}, {format_bytes(free)} are free there); "
                f"training stopped, the checkpoints already saved are intact ({kept}); free "
                "space or move the workdir, then run the same command to resume"
            ) from None

    def restore_latest(self, abstract_state, check=None, layout=None, *, step=None, fix=None):
        """(step, state, meta) of the newest checkpoint that restores (of `step` only, when
        given), or None if there is none.

        `abstract_state` carries the target shardings (ShapeDtypeStructs or arrays). Before the
        state is read, `check(meta, saved_shapes)` may refuse the checkpoint by raising, and a
        checkpoint whose state differs from `abstract_state` in structure, shape or dtype (the
        first differing path named) is a ShapeError ending with `fix`: a different model or
        optimizer is not damage, and nothing is moved. `layout(abstract_state, saved_shapes)`
        may give another tree to restore into and a function from it to `abstract_state`'s
        layout. A checkpoint whose files are damaged (truncated, missing, unparsable) is named
        in a warning and moved to `checkpoints_damaged/` beside the checkpoints (never deleted);
        the one before it is tried next. Any other failure to read (memory, permissions, a flaky
        file system), or damage to every checkpoint, is a CheckpointError that leaves the
        checkpoints where they are.
        """
        _reported_reads.add(self.directory + os.sep)
        steps = sorted(self.steps(), reverse=True)
        if step is not None:
            if step not in steps:
                found = ", ".join(map(str, sorted(steps))) or "none"
                raise CheckpointError(
                    f"{self.directory} holds no checkpoint of step {step} (steps: {found})"
                )
            steps = [step]
        for step in steps:
            try:
                meta = self._manager.restore(
                    step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
                )[META]
                saved_tree = self._manager.item_metadata(step)[STATE].tree
            except Exception as e:
                self._set_aside(step, e)
                continue
            saved_shapes = shapes_by_path(saved_tree)
            if check is not None:
                check(meta, saved_shapes)
            source = f"checkpoint {os.path.join(self.directory, str(step))}"
            check_state_matches(abstract_state, saved_tree, source, fix)
            target, convert = (
                layout(abstract_state, saved_shapes) if layout else (abstract_state, None)
            )
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        **{
                            STATE: ocp.args.StandardRestore(target),
                            META: ocp.args.JsonRestore(),
                        }
                    ),
                )
            except Exception as e:
                if is_misfit(e):  # a difference the check above missed: still not damage
                    also = f", {fix}" if fix else ""
                    raise ShapeError(
                        f"{source} does not fit this state ({_first_line(e)}): the checkpoints "
                        "were saved by another model or setup and are left as they are; use the "
                        f"model and optimizer that saved them{also}"
                    ) from None
                self._set_aside(step, e)
                continue
            state = convert(restored[STATE]) if convert else restored[STATE]
            return step, state, meta
        if steps:
            raise CheckpointError(
                f"every checkpoint in {self.directory} is damaged (moved to "
                f"{self._damaged_dir()}); nothing was started and the workdir's logs are as they "
                "were; pass a new --workdir to train afresh"
            )
        return None

    def _damaged_dir(self) -> str:
        return os.path.join(os.path.dirname(self.directory), "checkpoints_damaged")

    def _set_aside(self, step: int, error: Exception) -> None:
        """Moves a damaged checkpoint aside; any other failure to read it is raised as is."""
        self._read_failed = True
        source = os.path.join(self.directory, str(step))
        summary = f"{type(error).__name__}: {_first_line(error)}"
        if not is_damage(error):
            raise CheckpointError(
                f"could not read checkpoint {source} ({summary}), which is not damage to its "
                "files: nothing was moved or started; fix the cause and run the same command again"
            ) from None
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        target = os.path.join(self._damaged_dir(), f"{step}-{stamp}")
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.move(source, target)
        self._manager.reload()
        logging.warning(
            "checkpoint %s is damaged (%s); moved it to %s and trying the one before",
            source,
            summary,
            target,
        )


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


def model_mismatch(abstract_state, saved_shapes: dict, source: str) -> str | None:
    """The first path or shape where a checkpoint's state (`saved_shapes`, by path) differs from
    `abstract_state`, layer by layer (stacked and per-layer blocks compare equal); None if it
    fits."""
    return first_mismatch(
        layer_stacks.per_layer_shapes(shapes_by_path(abstract_state)),
        layer_stacks.per_layer_shapes(saved_shapes),
        source,
    )


# ---------------------------------------------------------- the checkpoint folder itself
def check_checkpoints_dir(directory: str, *, checkpointing: bool = True, names=None) -> None:
    """Refuses, without writing, a checkpoint folder that exists but is not a directory this
    process may list, read and write; and, when `checkpointing` is off, one holding committed
    checkpoints (a run that cannot save must not skip or restart a run that could resume).
    `names` = (what the workdir and checkpoint_every are called to the caller)."""
    workdir_name, every_name = names or ("workdir", "checkpoint_every")
    if not os.path.lexists(directory):
        return
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"{directory} is a file, where the checkpoints directory belongs; move it away or "
            f"pass another {workdir_name}"
        )
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise CheckpointError(
            f"checkpoint directory {directory} cannot be read and written by this user "
            f"(permission denied); give it back read, write and search permission (chmod u+rwx) "
            f"or pass another {workdir_name}"
        )
    if checkpointing:
        return
    saved = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    if saved:
        raise WorkdirError(
            f"{os.path.dirname(directory)} holds checkpoints (steps {', '.join(map(str, saved))} "
            f"in {directory}) but {every_name}=0 turns checkpointing off, so this run could "
            f"neither resume them nor save; set {every_name} above 0 to resume, or pass a new "
            f"{workdir_name}"
        )


def restore_layout(abstract_state, saved_shapes):
    """(what to restore into, a function to this run's layout or None): a checkpoint whose
    layers are stacked differently from this run's (a pipelined run's, a plain run's) is read in
    its own layout and converted on the devices, into this run's shardings."""
    ours = layer_stacks.is_stacked(shapes_by_path(abstract_state))
    if layer_stacks.is_stacked(saved_shapes) == ours:
        return abstract_state, None
    target = (
        layer_stacks.to_per_layer(abstract_state)
        if ours
        else layer_stacks.to_stacked(abstract_state)
    )
    shardings = jax.tree.map(lambda x: x.sharding, abstract_state)
    convert = layer_stacks.to_stacked if ours else layer_stacks.to_per_layer
    return target, jax.jit(convert, out_shardings=shardings)


def numbered(folder: str, prefix: str = "") -> list[str]:
    """The subfolders (or files) `PREFIX<number>` of `folder`, highest number first."""
    if not os.path.isdir(folder):
        return []
    numbers = [n[len(prefix) :] for n in os.listdir(folder) if n.startswith(prefix)]
    found = sorted((int(n) for n in numbers if n.isdigit()), reverse=True)
    return [os.path.join(folder, f"{prefix}{n}") for n in found]


def peek_latest(directory: str):
    """(meta, saved state's metadata tree) of the newest readable checkpoint under `directory`,
    or None.

    Reads metadata files only, changes nothing, and takes no part in orbax's cross-process
    barriers (processes may call it while the directory changes under them); damaged
    checkpoints are skipped here and reported by `Checkpoints.restore_latest`."""
    for folder in numbered(directory):
        try:
            with open(os.path.join(folder, META, "metadata")) as f:
                meta = json.load(f)
            return meta, saved_tree(os.path.join(folder, STATE))
        except Exception:  # unreadable or uncommitted: skip it here
            continue
    return None


def saved_tree(directory: str):
    """The array metadata tree of one saved item. Orbax warns when an item is read outside its
    step directory's manager (no step-level `_CHECKPOINT_METADATA` beside it); for a read-only
    peek that is expected, so its warnings are muted here."""
    with FAILURES_REPORTED.held(), quiet.library_warnings_muted("orbax"):  # damage fails here
        return ocp.StandardCheckpointer().metadata(directory).item_metadata.tree


# ------------------------------------------------------------------------------- export
def export_params(directory: str, params) -> None:
    """Saves `params` as host numpy arrays: an inference checkpoint no strategy is needed for."""
    host = jax.tree.map(np.asarray, params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(directory), host, force=True)


def _first_line(error: Exception, limit: int = 200) -> str:
    return (str(error).strip().splitlines() or [""])[0][:limit]


# Checkpoint directories `restore_latest` reads: it reports every failure to read them, damage
# in a warning and the rest in a CheckpointError.
_reported_reads: set[str] = set()


class _ReportedFailures(std_logging.Filter):
    """orbax logs a failed write, traceback and all, from each thread it passes through, and
    asyncio reports a failed write or read once more for each of orbax's tasks nobody awaited
    ("Task exception was never retrieved", when the garbage collector gets to them). The
    CheckpointError that `Checkpoints` raises, or its warning about a damaged checkpoint, says it
    once, in one line: these records are dropped."""

    def filter(self, record) -> bool:
        from_orbax = "/orbax/" in record.pathname or record.name == "asyncio"
        if not from_orbax or record.levelno < std_logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        failed_write = error is not None and write_failure(error) is not None
        text = f"{record.getMessage()} {error}"
        failed_read = any(directory in text for directory in _reported_reads)
        return not (failed_write or failed_read or "os_error_code=" in record.getMessage())


def _is_closed_loop(unraisable) -> bool:
    """After a failed read, tensorstore finishes the reads still in flight and hands each result
    to the event loop orbax has already closed; each hand-off ends in a `RuntimeError: Event loop
    is closed` printed through `sys.unraisablehook`."""
    error = unraisable.exc_value
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


# While held, the failures `Checkpoints` reports itself are not reported again on the console.
FAILURES_REPORTED = quiet.together(
    quiet.log_filter(("absl", "asyncio"), _ReportedFailures()),
    quiet.drop_unraisable(_is_closed_loop),
)
