"""Where logged metrics go: `metrics.jsonl` in the workdir, and the trackers (`Writer`s:
TensorBoard by default, W&B, MLflow; jddp/observe/writers.py) each record's numbers."""

import json
import os
from collections.abc import Mapping

from absl import logging

from jddp.errors import WorkdirError
from jddp.observe import writers as writers_lib
from jddp.runtime import atomic_write


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` and sends its numbers to each
    tracker in `writers` (names or `Writer`s, checked by `writers.check_writers`), which get the
    run's `config` once they open.

    Only one process of a multi-process run should write: pass `enabled=False` elsewhere.
    """

    def __init__(
        self,
        workdir: str,
        *,
        start_step: int = 0,
        enabled: bool = True,
        writers=writers_lib.DEFAULT_WRITERS,
        config: Mapping | None = None,
    ):
        """Continues a run restored at `start_step`: records of later steps (written before the
        run stopped, and about to be written again) are dropped from metrics.jsonl and
        TensorBoard."""
        self.enabled = enabled
        if not enabled:
            return
        self.path = os.path.join(workdir, "metrics.jsonl")
        _drop_records_after(self.path, start_step)
        self._file = open(self.path, "a")
        self._writers = []
        try:
            self._writers = writers_lib.open_writers(writers, workdir, start_step)
            for writer in self._writers:
                writer.write_config(dict(config or {}))
        except BaseException:
            self.close()
            raise

    def rewind(self, step: int) -> None:
        """Drops the records after `step`, as a restart at `step` does (a rollback)."""
        if not self.enabled:
            return
        self._file.close()
        _drop_records_after(self.path, step)
        self._file = open(self.path, "a")
        for writer in self._writers:
            writer.rewind(step)

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
        numbers = writers_lib.scalars(record)
        for writer in self._writers:
            writer.write(step, numbers)

    def close(self) -> None:
        """Closes metrics.jsonl and every tracker (each even if one before it failed)."""
        if not self.enabled:
            return
        try:
            self._file.close()
        except OSError as e:
            logging.warning("could not finish writing %s: %s", self.path, e.strerror)
        _close_all(self._writers)


def _close_all(writers) -> None:
    if writers:
        try:
            writers[0].close()
        finally:
            _close_all(writers[1:])


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
