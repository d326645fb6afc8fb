"""Where logged metrics go: `metrics.jsonl` and TensorBoard event files in the workdir."""

import json
import os
import sys

from absl import logging

from jddp.errors import WorkdirError
from jddp.runtime import atomic_write, quiet


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` and mirrors it to TensorBoard.

    Only one process of a multi-process run should write: pass `enabled=False` elsewhere.
    """

    def __init__(self, workdir: str, *, start_step: int = 0, enabled: bool = True):
        """Continues a run restored at `start_step`: records of later steps (written before the
        run stopped, and about to be written again) are dropped from both."""
        self.enabled = enabled
        if not enabled:
            return
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tensorboard_dir = os.path.join(workdir, "tensorboard")
        self._open(start_step)

    def _open(self, step: int) -> None:
        _drop_records_after(self.path, step)
        self._file = open(self.path, "a")
        self._tensorboard = _summary_writer_class()(self._tensorboard_dir, purge_step=step + 1)

    def rewind(self, step: int) -> None:
        """Drops the records after `step` from both, as a restart at `step` does (a rollback)."""
        if not self.enabled:
            return
        self._file.close()
        self._tensorboard.close()
        self._open(step)

    def write(self, step: int, metrics: dict) -> None:
        """One record: numbers (ints stay ints), and JSON-able notes such as `config_changes`,
        which only `metrics.jsonl` receives. A failed write (a full disk) is a WorkdirError."""
        if not self.enabled:
            return
        record = {"step": int(step)}
        for name, value in metrics.items():
            record[name] = value if isinstance(value, int | dict | str) else float(value)
        try:
            # json writes floats with repr(): the shortest string that reads back bit-exactly.
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:
            raise WorkdirError(
                f"could not write {self.path}: {e.strerror}; free space or move the workdir, "
                "then run the same command to resume from the newest checkpoint"
            ) from None
        for name, value in record.items():
            if name != "step" and isinstance(value, int | float):
                tag = f"eval/{name[5:]}" if name.startswith("eval_") else f"train/{name}"
                self._tensorboard.add_scalar(tag, value, step)

    def close(self) -> None:
        """Closes both; TensorBoard files that cannot be written any more (a full disk) are a
        warning, not an error: metrics.jsonl holds every record."""
        if not self.enabled:
            return
        try:
            self._file.close()
            self._tensorboard.close()
        except OSError as e:
            logging.warning("could not finish writing %s: %s", self.path, e.strerror)


def _drop_records_after(path: str, step: int) -> None:
    """Keeps the records of steps up to `step` (later ones are about to be written again); a
    damaged line (a record cut short, NUL bytes from a crash) is appended to
    `metrics.jsonl.damaged` with one warning naming it, and any complete record in it is kept."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    kept, damaged = [], []
    for line in lines:
        records, pieces = _records_in(line)
        damaged.extend(pieces)
        kept.extend(r for r in records if _step_of(r) <= step)
    if kept == lines:
        return
    if damaged:
        with open(path + ".damaged", "a") as f:
            f.writelines(piece + "\n" for piece in damaged)
        logging.warning(
            "%s had %d damaged line(s) (cut short, or NUL bytes); set them aside in %s",
            path,
            len(damaged),
            path + ".damaged",
        )
    atomic_write.write_text(path, "".join(kept))  # a crash leaves the old file or the new one


def _records_in(line: str) -> tuple[list[str], list[str]]:
    """(complete records, each ending in a newline; damaged pieces) of one line. NUL bytes split
    a line into pieces (the whole line is set aside, NULs written as \\x00, and the records in
    it kept); a piece that is not a record may still end in one (a record appended after a torn
    one, on the same line)."""
    records, damaged = [], []
    for piece in line.replace("\x00", "\n").split("\n"):
        if not piece.strip():
            continue
        starts = [0] + [i for i in range(1, len(piece)) if piece.startswith('{"step"', i)]
        record = next((i for i in starts if _step_of(piece[i:]) is not None), None)
        if record is None:
            damaged.append(piece)
            continue
        if record:
            damaged.append(piece[:record])
        records.append(piece[record:] + "\n")
    if "\x00" in line:
        damaged = [line.rstrip("\n").replace("\x00", "\\x00")]
    return records, damaged


def _step_of(line: str) -> int | None:
    try:  # a line torn by a crash mid-write has no step
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _from_tensorboardx(thing) -> bool:
    module = getattr(thing, "__module__", "") or type(thing).__module__
    return module.startswith("tensorboardX")


# After `close` warned that TensorBoard files could not be written, tensorboardX retries at exit
# (an atexit callback) and its writer thread fails: nothing new to say. Those reports come after
# the run, so only a program that owns its process holds this (jddp/run/cli.py).
TENSORBOARDX_FAILURES = quiet.together(
    quiet.drop_unraisable(lambda unraisable: _from_tensorboardx(unraisable.object)),
    quiet.drop_thread_errors(lambda args: _from_tensorboardx(args.thread)),
)


def _summary_writer_class():
    """tensorboardX's `SummaryWriter`, imported when a writer first opens and without PyTorch:
    tensorboardX imports torch where it is installed (about 1 s, for every process of a run)
    only to accept torch tensors, and jddp logs floats. A torch the process already imported
    is left as it is."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        from tensorboardX import SummaryWriter
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter
