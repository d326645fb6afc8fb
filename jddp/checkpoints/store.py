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
import inspect
import json
import logging as std_logging
import os
import shutil
import time
import weakref
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from jddp.checkpoints import damage
from jddp.checkpoints.compatibility import check_state_matches, is_misfit
from jddp.checkpoints.damage import META, STATE
from jddp.core import layer_stacks
from jddp.core.tree_paths import path_str
from jddp.errors import CheckpointError, CheckpointUnreadable, ShapeError, WorkdirError
from jddp.observe.memory import format_bytes
from jddp.runtime import processes, quiet
from jddp.runtime.fs import write_failure

# Where the run holding the workdir moves the checkpoints it prunes (one atomic rename each, so
# a reader finds a step whole or not at all) before it deletes them.
PRUNED = ".pruned"
# How long `close` waits for the reads orbax abandoned after a failed one to end (they end when
# tensorstore finishes them), so that their reports are dropped while its filters are in place.
ABANDONED_READS_WAIT_S = 60
# What a failed read of a checkpoint is, agreed by every process: the worst one found counts.
_READ, _DAMAGED, _UNREADABLE = 0, 1, 2


class Checkpoints:
    """The checkpoints of one workdir: `save` every `every` steps (and when JAX reports a
    preemption across processes), keeping the newest `max_to_keep`.

    A save that fails to write (a full disk, a write error) raises CheckpointError, in one line
    naming the directory and the bytes it needs, from the call that finds out: `save`, `check`
    (cheap: call it every step) or `wait`. The checkpoints written before it stay as they were.

    Who may change what in the directory:
    - `holds_workdir=True`: the run holding the workdir's lock (jddp/runtime/workdir.py). It
      alone removes saves left unfinished, prunes to `max_to_keep` (each pruned step moved
      aside in one rename, then deleted) and sets damaged checkpoints aside.
    - by default, a writer beside it (`jddp.save`): it adds its own steps and never deletes,
      moves or renames anything else.
    - `read_only=True` (`jddp.restore`, evaluation beside a live run): it writes nothing at all,
      not even the directory.

    From construction to `close()`, the failures it reports itself are kept off the console
    (`FAILURES_REPORTED`); `close()` gives the process back its hooks and filters.
    """

    def __init__(
        self,
        directory: str,
        *,
        every: int = 1,
        max_to_keep: int | None = None,
        holds_workdir: bool = False,
        read_only: bool = False,
    ):
        self.directory = os.path.abspath(directory)
        self.holds_workdir = holds_workdir and not read_only
        check_checkpoints_dir(self.directory, write=not read_only)
        self._manager = None if read_only else self._writer(every, max_to_keep)
        self._reader = None  # built on the first read
        self._saving = None  # (step, bytes) of the save in flight
        self._failed = False
        self._abandoned_reads: list[weakref.ref] = []
        FAILURES_REPORTED.acquire()
        self._quieting = True

    def _writer(self, every: int, max_to_keep: int | None) -> ocp.CheckpointManager:
        # Every process must find the directory in the same state, or orbax's processes take
        # different paths (one creates it, the others do not) and its barriers mismatch.
        os.makedirs(self.directory, exist_ok=True)
        processes.barrier(f"checkpoints in {self.directory}")
        if self.holds_workdir and jax.process_index() == 0:
            shutil.rmtree(os.path.join(self.directory, PRUNED), ignore_errors=True)
        policies = ocp.checkpoint_managers
        prunes = bool(max_to_keep) and self.holds_workdir
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy(
                [policies.FixedIntervalPolicy(every), policies.PreemptionCheckpointingPolicy()]
            ),
            preservation_policy=policies.LatestN(max_to_keep) if prunes else None,
            todelete_subdir=PRUNED if prunes else None,
            enable_async_checkpointing=True,
            # A save cut short never counts as a checkpoint; only the holder removes it (in any
            # other process it may be the live run's save in progress).
            cleanup_tmp_directories=self.holds_workdir,
        )
        return ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

    def _read_manager(self) -> ocp.CheckpointManager:
        """orbax's read-only manager: it creates, cleans up and deletes nothing, and takes part
        in no barrier (each process reads alone; `_agree` joins their verdicts)."""
        if self._reader is None:
            here = jax.process_index()
            options = ocp.CheckpointManagerOptions(
                read_only=True,
                create=False,
                save_interval_steps=0,
                enable_async_checkpointing=False,
                lightweight_initialize=True,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    primary_host=here, active_processes={here}
                ),
            )
            with quiet.library_warnings_muted("orbax"):  # "Given directory is read only"
                self._reader = ocp.CheckpointManager(
                    self.directory, options=options, item_handlers=_handlers()
                )
        return self._reader

    def steps(self) -> list[int]:
        """The committed checkpoints' steps, oldest first."""
        if self._manager is None:
            return sorted(int(os.path.basename(p)) for p in numbered(self.directory))
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
        if self._manager is None:
            raise CheckpointError(f"{self.directory} was opened read-only; it cannot save")
        unfinished = os.path.join(self.directory, f"{step}{_TMP_SUFFIX}")
        if not self.holds_workdir and os.path.exists(unfinished):
            raise CheckpointUnreadable(
                f"a save of step {step} is in progress in {self.directory} ({unfinished}), or was "
                "left unfinished by a run that died; nothing was written: wait for it, or save "
                "another step"
            )
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
            self._delete_pruned()  # the previous save's pruning is done: orbax waited for it
        return started

    def _delete_pruned(self, *, folder_too: bool = False) -> None:
        """Deletes the checkpoints the holder pruned (moved into PRUNED first)."""
        pruned = os.path.join(self.directory, PRUNED)
        if not (self.holds_workdir and jax.process_index() == 0 and os.path.isdir(pruned)):
            return
        for name in os.listdir(pruned):  # only these: the save in flight may move in another
            shutil.rmtree(os.path.join(pruned, name), ignore_errors=True)
        if folder_too:
            shutil.rmtree(pruned, ignore_errors=True)

    def check(self) -> None:
        """Raises the failure of a save that has finished, if it failed; never waits."""
        if self._saving is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Blocks until every started save has committed (or one has failed: raised once)."""
        if self._failed or self._manager is None:
            return
        with self._write_failures():
            self._manager.wait_until_finished()
        self._saving = None

    def close(self) -> None:
        try:
            if self._reader is not None:
                self._reader.close()
            if self._manager is not None and not self._failed:
                # orbax would raise a reported failure again: then just let go
                self._manager.close()
                self._delete_pruned(folder_too=True)
        finally:
            if self._quieting:
                self._wait_for_abandoned_reads()
                self._quieting = False
                FAILURES_REPORTED.release()

    def _wait_for_abandoned_reads(self) -> None:
        """After a failed read, orbax leaves the reads still in flight to tensorstore; each is
        reported (a ~60-line "Exception ignored in: <coroutine object
        _read_array_index_and_device_put>", and asyncio's "Task exception was never retrieved")
        when it ends and the garbage collector reaches it. Waits for that, while those reports
        are still dropped (at most ABANDONED_READS_WAIT_S)."""
        deadline = time.monotonic() + ABANDONED_READS_WAIT_S
        while self._abandoned_reads:
            gc.collect()
            self._abandoned_reads = [r for r in self._abandoned_reads if r() is not None]
            if not self._abandoned_reads or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self._abandoned_reads = []

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
        layout.

        A checkpoint whose own files show damage (`jddp/checkpoints/damage.py`: missing,
        truncated, unparsable) is named in a warning and skipped for the one before it; the
        holder of the workdir also moves it to `checkpoints_damaged/` (never deleted). Any
        other failure to read (memory, permissions, a flaky file system, a step pruned while
        it was read) is a CheckpointUnreadable that leaves every file where it is, and damage
        to every checkpoint a CheckpointError. Every process restores the same step: process
        0's list of steps is used, and each read's verdict is agreed by all of them.
        """
        _reported_reads.add(self.directory + os.sep)
        steps = _agreed_steps(self.steps())[::-1]
        if step is not None:
            if step not in steps:
                found = ", ".join(map(str, sorted(steps))) or "none"
                raise CheckpointError(
                    f"{self.directory} holds no checkpoint of step {step} (steps: {found})"
                )
            steps = [step]
        for step in steps:
            found = self._restore(step, abstract_state, check, layout, fix)
            if found is not None:
                return found
        if not steps:
            return None
        if self.holds_workdir:
            raise CheckpointError(
                f"every checkpoint in {self.directory} is damaged (moved to "
                f"{self._damaged_dir()}); nothing was started and the workdir's logs are as they "
                "were; pass a new --workdir to train afresh"
            )
        raise CheckpointError(
            f"every checkpoint in {self.directory} is damaged; they were left where they are "
            "(the run that holds the workdir sets them aside when it starts)"
        )

    def _restore(self, step: int, abstract_state, check, layout, fix):
        """(step, state, meta) of checkpoint `step`; None when it is damaged."""
        reader = self._read_manager()
        failure = meta = saved_tree = None
        try:
            meta = reader.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[
                META
            ]
            saved_tree = reader.item_metadata(step)[STATE].tree
        except Exception as e:
            failure = e
        if self._agreed_damaged(step, failure):
            return None
        saved_shapes = shapes_by_path(saved_tree)
        if check is not None:
            check(meta, saved_shapes)
        source = f"checkpoint {os.path.join(self.directory, str(step))}"
        check_state_matches(abstract_state, saved_tree, source, fix)
        target, convert = layout(abstract_state, saved_shapes) if layout else (abstract_state, None)
        args = {STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()}
        restored = None
        try:
            restored = reader.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:
            if is_misfit(e):  # a difference the check above missed: still not damage
                also = f", {fix}" if fix else ""
                raise ShapeError(
                    f"{source} does not fit this state ({_first_line(e)}): the checkpoints "
                    "were saved by another model or setup and are left as they are; use the "
                    f"model and optimizer that saved them{also}"
                ) from None
            failure = e
        if self._agreed_damaged(step, failure):
            return None
        state = convert(restored[STATE]) if convert else restored[STATE]
        return step, state, meta

    def _agreed_damaged(self, step: int, failure: Exception | None) -> bool:
        """Whether checkpoint `step`, read by every process (`failure`: this one's error, or
        None), is damaged: then it has been set aside (by the holder) and skipped. Raises
        CheckpointUnreadable when any process failed to read it for another reason."""
        verdict, reason = (_READ, "") if failure is None else self._judge(step, failure)
        verdicts = _gathered(verdict)
        worst = max(verdicts)
        if worst == _UNREADABLE:
            if verdict != _UNREADABLE:
                reason = (
                    f"process {verdicts.index(_UNREADABLE)} could not read checkpoint "
                    f"{os.path.join(self.directory, str(step))} (its log says why); nothing was "
                    "moved; run the same command again"
                )
            raise CheckpointUnreadable(reason) from None
        if worst == _DAMAGED:
            self._set_aside(step, reason or f"process {verdicts.index(_DAMAGED)} found it so")
            return True
        return False

    def _judge(self, step: int, error: Exception) -> tuple[int, str]:
        self._abandoned_reads += _suspended_reads()
        return judge(os.path.join(self.directory, str(step)), error)

    def _damaged_dir(self) -> str:
        return os.path.join(os.path.dirname(self.directory), "checkpoints_damaged")

    def _set_aside(self, step: int, problem: str) -> None:
        """Names damaged checkpoint `step` in a warning; the holder (its process 0, once every
        process has agreed) moves it to `checkpoints_damaged/`, whoever else reads leaves it."""
        source = os.path.join(self.directory, str(step))
        if not self.holds_workdir:
            logging.warning(
                "checkpoint %s is damaged (%s); left where it is for the run holding the workdir "
                "to set aside, and trying the one before",
                source,
                problem,
            )
            return
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        target = os.path.join(self._damaged_dir(), f"{step}-{stamp}")
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(source, target)
        processes.barrier(f"checkpoint {step} set aside")
        self._manager.reload()
        logging.warning(
            "checkpoint %s is damaged (%s); moved it to %s and trying the one before",
            source,
            problem,
            target,
        )


def judge(source: str, error: Exception) -> tuple[int, str]:
    """(_DAMAGED, what in its files shows it) or (_UNREADABLE, the one line to raise) for a
    failed read of checkpoint `source` (a step directory), from its files, not from `error`'s
    text."""
    summary = f"{type(error).__name__}: {_first_line(error)}"
    try:
        problem = damage.damage_in(source)
    except OSError as e:
        problem = e
    if not os.path.isdir(source):
        return _UNREADABLE, (
            f"checkpoint {source} was removed while it was read (the run holding the workdir "
            "prunes its older checkpoints); run the same command again to read the newest"
        )
    if isinstance(problem, OSError):
        return _UNREADABLE, (
            f"could not read checkpoint {source} ({summary}; {problem.strerror}: "
            f"{problem.filename}), which is not damage to its files: nothing was moved; fix the "
            "cause and run the same command again"
        )
    if problem is None:
        return _UNREADABLE, (
            f"could not read checkpoint {source} ({summary}), though its files are complete: "
            "not damage, so nothing was moved; fix the cause and run the same command again"
        )
    return _DAMAGED, problem


def read_failure(source: str, error: Exception) -> CheckpointError:
    """The one-line error for a failed read of checkpoint `source` by a reader, which moves
    nothing: damage (a CheckpointError), or a CheckpointUnreadable."""
    verdict, reason = judge(source, error)
    if verdict == _DAMAGED:
        return CheckpointError(
            f"checkpoint {source} is damaged ({reason}); it was left where it is (the run "
            "holding the workdir sets it aside when it starts); read an earlier step"
        )
    return CheckpointUnreadable(reason)


def _handlers() -> dict:
    return {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}


# The name orbax gives a step's save in progress: `STEP.orbax-checkpoint-tmp`.
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _gathered(value: int) -> list[int]:
    """`value` of every process, by process index (through the coordinator's collectives)."""
    if jax.process_count() == 1:
        return [value]
    gathered = multihost_utils.process_allgather(np.array([value], np.int32))
    return [int(v) for v in np.asarray(gathered).reshape(-1)]


def _agreed_steps(steps: list[int]) -> list[int]:
    """Process 0's `steps` on every process: a reader beside a live run may list the directory
    a moment apart from the others."""
    if jax.process_count() == 1:
        return list(steps)
    count = int(multihost_utils.broadcast_one_to_all(np.int32(len(steps))))
    padded, known = np.zeros(count, np.int64), min(count, len(steps))
    padded[:known] = steps[:known]
    return [int(s) for s in multihost_utils.broadcast_one_to_all(padded)]


def _suspended_reads() -> list[weakref.ref]:
    """orbax's coroutines still suspended (reads tensorstore has in flight), weakly."""
    return [
        weakref.ref(o)
        for o in gc.get_objects()
        if inspect.iscoroutine(o) and o.cr_frame is not None and _is_orbax(o)
    ]


def _is_orbax(coroutine) -> bool:
    return f"{os.sep}orbax{os.sep}" in coroutine.cr_code.co_filename


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
def check_checkpoints_dir(
    directory: str, *, checkpointing: bool = True, names=None, write: bool = True
) -> None:
    """Refuses, without writing, a checkpoint folder that exists but is not a directory this
    process may list, read and (with `write`) write; and, when `checkpointing` is off, one
    holding committed checkpoints (a run that cannot save must not skip or restart a run that
    could resume). `names` = (what the workdir and checkpoint_every are called to the caller)."""
    workdir_name, every_name = names or ("workdir", "checkpoint_every")
    if not os.path.lexists(directory):
        return
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"{directory} is a file, where the checkpoints directory belongs; move it away or "
            f"pass another {workdir_name}"
        )
    if not os.access(directory, os.R_OK | os.X_OK | (os.W_OK if write else 0)):
        needed = "read and written" if write else "read"
        raise CheckpointError(
            f"checkpoint directory {directory} cannot be {needed} by this user (permission "
            f"denied); give it back read, {'write ' if write else ''}and search permission "
            f"(chmod u+r{'w' if write else ''}x) or pass another {workdir_name}"
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
    barriers (processes may call it while the directory changes under them). A checkpoint whose
    files show damage, or that was pruned while it was read, is skipped here (and reported by
    `Checkpoints.restore_latest`); any other failure to read is a CheckpointUnreadable."""
    for folder in numbered(directory):
        try:
            with open(os.path.join(folder, META, "metadata")) as f:
                meta = json.load(f)
            return meta, saved_tree(os.path.join(folder, STATE))
        except Exception as e:
            try:
                damaged = damage.damage_in(folder)
            except OSError:
                damaged = None
            if damaged or not os.path.isdir(folder):
                continue
            raise CheckpointUnreadable(
                f"could not read the metadata of checkpoint {folder} ({type(e).__name__}: "
                f"{_first_line(e)}), which is not damage to its files: nothing was moved; fix "
                "the cause and run the same command again"
            ) from None
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


def _is_abandoned_read(unraisable) -> bool:
    """A read orbax left in flight after a failed one, of a checkpoint `restore_latest` has
    reported, closed by the garbage collector: orbax turns the close (GeneratorExit) into a
    ~60-line "Exception ignored in: <coroutine object _read_array_index_and_device_put>"."""
    coroutine, text = unraisable.object, str(unraisable.exc_value)
    return (
        inspect.iscoroutine(coroutine)
        and _is_orbax(coroutine)
        and any(directory in text for directory in _reported_reads)
    )


# While held, the failures `Checkpoints` reports itself are not reported again on the console.
FAILURES_REPORTED = quiet.together(
    quiet.log_filter(("absl", "asyncio"), _ReportedFailures()),
    quiet.drop_unraisable(lambda report: _is_closed_loop(report) or _is_abandoned_read(report)),
)
