"""A run's workdir: checked before anything is written, held by one live run at a time (a lock
file naming the holder; a lock left by a run that died is taken over), and checked to be the same
directory on every process of a job (storage every host mounts)."""

import contextlib
import errno
import fcntl
import os
import secrets
import socket
import stat

import jax
import numpy as np

from jddp.errors import WorkdirBusy, WorkdirError
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
    WorkdirBusy naming that run's process and host; a lock left by a run that died (the kernel
    released its flock) is taken over. Only process 0 of a job locks (all share the workdir).
    A run holds its workdir once: a second hold, even by the same process, is refused."""
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise WorkdirError(f"workdir {workdir!r} cannot be created: {e.strerror}") from None
    fd = _lock(workdir) if jax.process_index() == 0 else None
    try:
        check_shared(workdir)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock; the file stays (deleting it would race)


def check_shared(workdir: str) -> None:
    """A WorkdirError on every process unless `workdir` is the same directory on every process
    of the job (a no-op for one): process 0 creates a marker file of a random name in it, the
    name goes to the others with a collective, and each looks for the file in its own
    `workdir`; the verdicts are gathered, so every process stops, or none."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    token = np.frombuffer(secrets.token_bytes(8), np.uint32)
    token = np.asarray(multihost_utils.broadcast_one_to_all(token))  # process 0's
    name = f".shared-{token.tobytes().hex()}"
    marker = os.path.join(workdir, name)
    if jax.process_index() == 0:
        with open(marker, "w"):
            pass
    multihost_utils.sync_global_devices("jddp: workdir marker written")
    seen = False
    for _ in range(2):  # a second look after the first one's round trip, should a cache lag
        # Listing opens the directory, which NFS revalidates (close-to-open consistency).
        seen = seen or name in os.listdir(workdir)
        seen_by = np.asarray(multihost_utils.process_allgather(np.asarray([seen], np.int32)))
        if seen_by.all():
            break
    if jax.process_index() == 0:
        os.remove(marker)
    apart = [p for p, ok in enumerate(seen_by.reshape(-1)) if not ok]
    if apart:
        raise WorkdirError(
            f"workdir {workdir!r} is not the same directory on every process: "
            f"{'processes' if len(apart) > 1 else 'process'} {', '.join(map(str, apart))} "
            f"{'do' if len(apart) > 1 else 'does'} not see the file process 0 created in it; "
            "put the workdir on storage every host mounts at the same path (a shared file "
            "system), not on a disk of each host's own"
        )


# The holder's "PID HOST", written over the start of the file and padded to this length
# (hostnames have at most 64 bytes): the file is never truncated, so a reader never sees it empty.
_HOLDER_BYTES = 128
# flock refused by the file system itself (NFS without lockd, Lustre mounted without `flock`).
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


def _lock(workdir: str) -> int:
    path = os.path.join(workdir, LOCK_FILE)
    fd = _open_lock_file(workdir, path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, _HOLDER_BYTES, 0).decode(errors="replace").split()
        os.close(fd)
        pid, host = (holder + ["?", "?"])[:2]
        raise WorkdirBusy(
            f"workdir {workdir!r} is in use by a run in process {pid} on {host} ({path}); wait "
            "for it to end or stop it, or pass another workdir"
        ) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in _NO_FLOCK:
            raise WorkdirError(f"cannot lock {path}: {e.strerror}; pass another workdir") from None
        raise WorkdirError(
            f"the file system of workdir {workdir!r} does not lock files ({path}: "
            f"{e.strerror}); pass a workdir on a file system with working flock (a local disk), "
            "or mount this one with locking on (NFS: lockd running, or the local_lock=flock "
            "option; Lustre: the flock option)"
        ) from None
    holder = f"{os.getpid()} {socket.gethostname()}".ljust(_HOLDER_BYTES - 1) + "\n"
    os.pwrite(fd, holder.encode()[:_HOLDER_BYTES], 0)
    return fd


def _open_lock_file(workdir: str, path: str) -> int:
    """The lock file, opened for writing without following a symbolic link and without
    truncating; a WorkdirError unless it is a plain file of its own (a link planted in a
    shared workdir would have the run write into the file it points to)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        problem = (
            "is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
        )
        raise WorkdirError(
            f"the lock file {path} {problem}; remove it (jddp creates a plain file), or pass "
            "another workdir"
        ) from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
        os.close(fd)
        what = "is not a regular file" if not stat.S_ISREG(status.st_mode) else "has other links"
        raise WorkdirError(
            f"the lock file {path} {what}; remove it (jddp creates a plain file), or pass "
            f"another workdir ({workdir!r})"
        )
    return fd
