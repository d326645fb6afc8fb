"""Files and folders written whole or not at all: a crash, a full disk or an exception mid-write
leaves the old version or the new one, never a torn mix.

A file is written to a temporary name beside it, fsynced, renamed over the old one, and its
folder fsynced (the rename itself is then durable). A folder is built under a temporary name and
swapped in by renames once it is complete. Append-only logs (metrics.jsonl) stay appends: a torn
last line is what their readers expect.
"""

import contextlib
import errno
import glob
import json
import os
import secrets
import shutil

# Directories some file systems cannot fsync (network and FUSE mounts answer EINVAL or ENOTSUP),
# or that can be written but not opened for reading: the rename is done, only its durability is
# left to the file system.
_DIRECTORY_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}


def write_text(path: str, text: str) -> None:
    """Writes `text` (UTF-8) to `path`, whole or not at all."""
    with replacing(path) as f:
        f.write(text)


def write_json(path: str, document, *, durable: bool = True, **dump_options) -> None:
    """Writes `document` as JSON (`json.dump`'s options, then a newline) to `path`, whole or not
    at all: a value that cannot be serialized leaves the old file as it was. Without `durable`
    nothing is fsynced: still whole when the process dies, but not when the machine does (for a
    file rewritten every second, that is made durable at longer intervals)."""
    with replacing(path, durable=durable) as f:
        json.dump(document, f, **dump_options)
        f.write("\n")


TEMPORARY_SUFFIX = ".tmp"  # `.NAME.RANDOM.tmp` beside NAME while it is written


@contextlib.contextmanager
def replacing(path: str, *, binary: bool = False, durable: bool = True):
    """A file to write (text, UTF-8, or `binary`); on leaving the block it is fsynced
    (`durable`) and renamed to `path`, or, on an exception, removed."""
    folder = os.path.dirname(os.path.abspath(path))
    name = f".{os.path.basename(path)}.{secrets.token_hex(4)}{TEMPORARY_SUFFIX}"
    temporary = os.path.join(folder, name)
    # 0o666 less the umask, as open(path, "w") would create it (mkstemp's 0o600 would not)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    if durable:
        fsync_directory(folder)


def fsync_file(path: str) -> None:
    """Flushes a file someone else wrote (numpy, safetensors) to the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: str) -> None:
    """Makes the names in `path` (files created, renamed or removed there) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno not in _DIRECTORY_FSYNC_UNSUPPORTED:
            raise


def fsync_tree(path: str) -> None:
    """fsyncs every file and folder under `path` (a folder about to be renamed into place)."""
    for folder, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(folder, name))
        fsync_directory(folder)


@contextlib.contextmanager
def replacing_directory(path: str, *, swap: bool = True):
    """A folder to build beside `path` (`PATH.next`, yielded); once the block ends it is made
    durable and swapped in by renames: the old `path` stays whole until the new one is complete,
    and an exception in the block leaves it as it was (and removes `PATH.next`). In a job of
    several processes all write into the same `PATH.next` and one (`swap`) swaps it in.

    The two names beside `path` (`.next`, `.old`) are this writer's own: call it only where the
    caller holds `path`'s parent (a workdir held by its run), never into a shared folder."""
    path = os.path.abspath(path)
    staged, old = f"{path}.next", f"{path}.old"
    if swap and os.path.isdir(old) and not os.path.exists(path):  # a swap cut between renames
        os.rename(old, path)
    try:
        yield staged
    except BaseException:
        if swap:  # what this writer made: PATH.next, and what a writer into it left beside it
            for made in (staged, *glob.glob(glob.escape(staged) + ".*")):
                shutil.rmtree(made, ignore_errors=True)
        raise
    if not swap:
        return
    fsync_tree(staged)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staged, path)
    fsync_directory(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)
