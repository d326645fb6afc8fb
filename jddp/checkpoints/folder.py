"""The checkpoint folder itself: whether this process may use it (checked before anything is
written), and its numbered entries (`STEP/`, `checkpoint_N`), newest first."""

import os

from jddp.errors import CheckpointError, WorkdirError


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


def numbered(folder: str, prefix: str = "") -> list[str]:
    """The subfolders (or files) `PREFIX<number>` of `folder`, highest number first."""
    if not os.path.isdir(folder):
        return []
    numbers = [n[len(prefix) :] for n in os.listdir(folder) if n.startswith(prefix)]
    found = sorted((int(n) for n in numbers if n.isdigit()), reverse=True)
    return [os.path.join(folder, f"{prefix}{n}") for n in found]
