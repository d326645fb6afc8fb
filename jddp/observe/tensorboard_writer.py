"""The TensorBoard writer (the default): event files in WORKDIR/tensorboard, written with
tensorboardX (a dependency of jddp), the run's config as text."""

import json
import os
import sys
from collections.abc import Mapping

from absl import logging

from jddp.runtime import quiet


class TensorBoardWriter:
    """Scalars to WORKDIR/tensorboard; a start (or rewind) at step S hides the events after S
    that an earlier start wrote (TensorBoard's `purge_step`)."""

    def __init__(self, workdir: str, start_step: int = 0):
        self._directory = os.path.join(workdir, "tensorboard")
        self._open(start_step)

    def _open(self, step: int) -> None:
        self._writer = _summary_writer_class()(self._directory, purge_step=step + 1)
        self._step = step

    def write_config(self, config: Mapping) -> None:
        text = json.dumps(dict(config), indent=2, sort_keys=True, default=str)
        self._writer.add_text("config", f"```\n{text}\n```", self._step)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def rewind(self, step: int) -> None:
        self._writer.close()
        self._open(step)

    def close(self) -> None:
        """Files that cannot be written any more (a full disk) are a warning, not an error:
        metrics.jsonl holds every record."""
        try:
            self._writer.close()
        except OSError as e:
            logging.warning("could not finish writing %s: %s", self._directory, e.strerror)


def open_writer(workdir: str, start_step: int) -> TensorBoardWriter:
    return TensorBoardWriter(workdir, start_step)


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
