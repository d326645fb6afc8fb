"""`NewestCheckpoint`: what a workdir's newest checkpoint says (its step, the config and model
arguments it was written with, its elastic record, its saved shapes), read once per start and
handed to everything that decides how the start goes (the model's arguments, the accumulation of
an elastic restart, the checks before resuming). The restore itself reads the state later."""

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from jddp.checkpoints import peek
from jddp.checkpoints.compatibility import shapes_by_path


@dataclasses.dataclass(frozen=True)
class NewestCheckpoint:
    """The newest readable checkpoint under `directory`: its metadata (`meta`; None when there is
    none, or checkpointing is off) and its saved state's metadata tree (`saved_tree`)."""

    directory: str
    meta: Mapping | None = None
    saved_tree: Any = None

    @classmethod
    def read(cls, workdir: str, *, checkpointing: bool = True) -> "NewestCheckpoint":
        """Reads `workdir/checkpoints`' newest checkpoint's metadata files (nothing when
        `checkpointing` is off: such a run resumes nothing)."""
        directory = os.path.join(workdir, "checkpoints")
        found = peek.peek_latest(directory) if checkpointing else None
        return cls(directory, *(found or ()))

    @property
    def step(self) -> int | None:
        """The checkpoint's step; None: there is none."""
        return None if self.meta is None else int(self.meta["step"])

    @property
    def config(self) -> dict:
        """The config it was written with ({} without one: a library run's, or none)."""
        return dict((self.meta or {}).get("config") or {})

    def get(self, key: str, default=None):
        """One entry of its metadata (`default` when absent, or without a checkpoint)."""
        return (self.meta or {}).get(key, default)

    def saved_shapes(self) -> dict[str, tuple[int, ...]]:
        """{path: shape} of every saved state leaf."""
        return shapes_by_path(self.saved_tree)
