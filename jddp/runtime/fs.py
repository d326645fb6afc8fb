"""File-system conditions in words: whether a directory can be used as asked (checked before
anything is written), and what a failed write means (a full disk, a write error). Whether a
failed read means damage is judged from a checkpoint's files: jddp/checkpoints/damage.py."""

import os
import re


def directory_problem(path: str, *, write: bool) -> str | None:
    """Why `path` cannot serve as a directory (to create or write into, with `write`), as a
    phrase such as "is a file"; None if it can."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file"
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # the nearest existing ancestor decides
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        return f"is under {existing!r}, which is a file"
    if write:
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return f"is on a read-only file system ({existing!r})"
        if not os.access(existing, os.W_OK | os.X_OK):
            return f"cannot be written (no permission to write in {existing!r})"
    return None


def _causes(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _os_error_code(error: BaseException) -> int | None:
    """The errno of an OSError, or of an OS failure tensorstore reports in its message."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    match = re.search(r"os_error_code='?(\d+)", str(error))
    return int(match.group(1)) if match else None


def write_failure(error: BaseException) -> str | None:
    """The operating system's reason ("No space left on device") when `error` or what caused it
    is a failed write to a file, else None."""
    for cause in _causes(error):
        code = _os_error_code(cause)
        if code is not None:
            return os.strerror(code)
    return None
