"""A look at the newest checkpoint without restoring it: its metadata and its saved state's
metadata tree, read from the files alone, changing nothing and joining no barrier (a reader may
peek while a live run saves and prunes)."""

import json
import os

import orbax.checkpoint as ocp

from jddp.checkpoints import damage
from jddp.checkpoints.damage import META, STATE
from jddp.checkpoints.folder import numbered
from jddp.checkpoints.orbax_noise import FAILURES_REPORTED
from jddp.errors import CheckpointUnreadable, first_line
from jddp.runtime import quiet


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
                f"{first_line(e)}), which is not damage to its files: nothing was moved; fix "
                "the cause and run the same command again"
            ) from None
    return None


def saved_tree(directory: str):
    """The array metadata tree of one saved item. Orbax warns when an item is read outside its
    step directory's manager (no step-level `_CHECKPOINT_METADATA` beside it); for a read-only
    peek that is expected, so its warnings are muted here. The path is made absolute: orbax
    reads no item metadata under a relative one (and says so only in a warning)."""
    directory = os.path.abspath(directory)
    with FAILURES_REPORTED.held(), quiet.library_warnings_muted("orbax"):  # damage fails here
        return ocp.StandardCheckpointer().metadata(directory).item_metadata.tree
