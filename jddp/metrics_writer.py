"""Where logged metrics go: `metrics.jsonl` and TensorBoard event files in the workdir."""

import json
import os

from tensorboardX import SummaryWriter


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` and mirrors it to TensorBoard.

    Only one process of a multi-process run should write: pass `enabled=False` elsewhere.
    """

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._file = open(self.path, "a")
        self._tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{name: float(value) for name, value in metrics.items()}}
        # json writes floats with repr(): the shortest string that reads back bit-exactly.
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for name, value in record.items():
            if name != "step":
                tag = f"eval/{name[5:]}" if name.startswith("eval_") else f"train/{name}"
                self._tensorboard.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tensorboard.close()
