"""Checkpoints with orbax: asynchronous saves with atomic commits, pruning, and restore into any
strategy's shardings with a fallback past a damaged latest checkpoint, agreed by every process.

A checkpoint directory `WORKDIR/checkpoints/STEP/` holds two items: `state` (the whole
`TrainState`: parameters, optimizer state, mutable collections, RNG key, step, non-finite count)
and `meta` (JSON: the resolved config, strategy, mesh, device and process counts, jddp version,
and the data iterator's state). The state is saved as global arrays, so restoring into another
strategy or device count is restoring into other shardings: orbax reshards on load.

Beside it in jddp/checkpoints/: whether a saved state fits (`compatibility.py`: another model is
refused, never set aside as damage), what a failed read is (`read_verdicts.py`, from the files:
`damage.py`), the newest checkpoint's metadata without a restore (`peek.py`), the folder's checks
(`folder.py`), orbax's echoes kept off the console (`orbax_noise.py`), the export (`export.py`)
and weights to start a run from (`weights.py`).
"""

import contextlib
import datetime
import os
import shutil
import weakref
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from jddp.checkpoints import orbax_noise
from jddp.checkpoints.compatibility import check_state_matches, is_misfit, shapes_by_path
from jddp.checkpoints.damage import META, STATE
from jddp.checkpoints.folder import check_checkpoints_dir, numbered
from jddp.checkpoints.read_verdicts import (
    DAMAGED,
    READ,
    agreed_steps,
    agreed_verdict,
    judge,
)
from jddp.errors import CheckpointError, CheckpointUnreadable, ShapeError, first_line
from jddp.observe.memory import format_bytes
from jddp.runtime import processes, quiet
from jddp.runtime.fs import write_failure

# Where the run holding the workdir moves the checkpoints it prunes (one atomic rename each, so
# a reader finds a step whole or not at all) before it deletes them.
PRUNED = ".pruned"


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
    (`orbax_noise.FAILURES_REPORTED`); `close()` gives the process back its hooks and filters.
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
        orbax_noise.FAILURES_REPORTED.acquire()
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
        in no barrier (each process reads alone; `agreed_verdict` joins their verdicts)."""
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
        return self._manager is not None and self._manager.should_save(step)

    def save(self, step: int, state, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Starts an asynchronous save if `step` is due (or `force`); returns whether it did.
        A step already saved is left as it is (one line in the log), not saved again."""
        if self._manager is None:
            raise CheckpointError(f"{self.directory} was opened read-only; it cannot save")
        if step in self._manager.all_steps():
            logging.info(
                "checkpoint of step %d already in %s; not saved again", step, self.directory
            )
            return False
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
                orbax_noise.wait_for_abandoned_reads(self._abandoned_reads)
                self._abandoned_reads = []
                self._quieting = False
                orbax_noise.FAILURES_REPORTED.release()

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
        orbax_noise.reported_reads.add(self.directory + os.sep)
        steps = agreed_steps(self.steps())[::-1]
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
                    f"{source} does not fit this state ({first_line(e)}): the checkpoints "
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
        verdict, reason = (READ, "") if failure is None else self._judge(step, failure)
        worst, reason = agreed_verdict(verdict, reason, os.path.join(self.directory, str(step)))
        if worst == DAMAGED:
            self._set_aside(step, reason)
        return worst == DAMAGED

    def _judge(self, step: int, error: Exception) -> tuple[int, str]:
        self._abandoned_reads += orbax_noise.suspended_reads()
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


def _handlers() -> dict:
    return {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}


# The name orbax gives a step's save in progress: `STEP.orbax-checkpoint-tmp`.
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
