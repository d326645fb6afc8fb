"""A run's workdir: checked before anything is written, and held by one live run at a time
(a lock file naming the holder; a lock left by a run that died is taken over)."""

import contextlib
import fcntl
import os
import socket

import jax

from jddp.errors import WorkdirError
from jddp.runtime.fs import directory_problem


def check_workdir(workdir: str, *, resumable: bool, name: str = "workdir") -> None:
    """Refuses, without writing: a path that cannot be a writable directory, and a directory
    holding a run this one cannot continue (one without checkpoints, or when checkpointing is
    off, or whose checkpoints were all damaged and set aside). `name` is how the fix calls the
    workdir ("--workdir" on the command line)."""
    problem = directory_problem(workdir, write=True)
    if problem:
        raise WorkdirError(
            f"workdir {workdir!r} {problem}; pass a directory you can write to as {name}"
        )
    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        return
    if not (resumable and os.path.isdir(checkpoints)):
        raise WorkdirError(
            f"workdir {workdir!r} already holds a run without checkpoints to resume "
            f"(metrics.jsonl); pass a new {name}"
        )
    damaged = os.path.join(workdir, "checkpoints_damaged")
    if os.path.isdir(damaged) and not any(n.isdigit() for n in os.listdir(checkpoints)):
        raise WorkdirError(
            f"workdir {workdir!r} holds a run whose checkpoints were all damaged (set aside in "
            f"{damaged}); pass a new {name} to train afresh"
        )


LOCK_FILE = ".lock"


@contextlib.contextmanager
def hold_workdir(workdir: str):
    """Creates `workdir` and holds it for this process: a live run holding it already is a
    WorkdirError naming that run's process and host; a lock left by a run that died (the kernel
    released its flock) is taken over. Only process 0 of a job locks (all share the workdir).
    A run holds its workdir once: a second hold, even by the same process, is refused."""
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise WorkdirError(f"workdir {workdir!r} cannot be created: {e.strerror}") from None
    if jax.process_index() != 0:
        yield
        return
    fd = _lock(workdir)
    try:
        yield
    finally:
        os.close(fd)  # releases the flock; the file stays (deleting it would race)


def _lock(workdir: str) -> int:
    path = os.path.join(workdir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").split()
        os.close(fd)
        pid, host = (holder + ["?", "?"])[:2]
        raise WorkdirError(
            f"workdir {workdir!r} is in use by a run in process {pid} on {host} ({path}); wait "
            "for it to end or stop it, or pass another workdir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd
