"""Where `fit`'s records go besides `metrics.jsonl`: the `Writer` protocol every tracker fills,
the built-in trackers by name (`tensorboard`, `wandb`, `mlflow`), and the tracker run ids a
workdir keeps so that a resumed run continues the same tracker run.

    jddp.fit(..., writers=("tensorboard", "wandb"))   # or a Writer of your own

Each tracker but TensorBoard is an extra (`pip install 'jddp[wandb]'`); a name whose package is
missing is a ConfigError before anything is written.
"""

import importlib
import importlib.util
import json
import os
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

from jddp.errors import ConfigError
from jddp.runtime import atomic_write

DEFAULT_WRITERS = ("tensorboard",)
# name: (module under jddp.observe, the package it imports, the extra that installs it)
BUILT_IN = {
    "tensorboard": ("tensorboard_writer", None, None),  # tensorboardX: a dependency of jddp
    "wandb": ("wandb_writer", "wandb", "wandb"),
    "mlflow": ("mlflow_writer", "mlflow", "mlflow"),
}
RUN_IDS = "trackers.json"  # in the workdir: {tracker name: its run id}


@runtime_checkable
class Writer(Protocol):
    """What `fit` calls of a tracker, on process 0 only: the run's config once it has started,
    the scalars of each record, a rewind when a rollback goes back to a step, and a close at
    the end of the start (also after an error)."""

    def write_config(self, config: Mapping) -> None:
        """The run's config (nested JSON-able values), at every start: a resume sends it again."""

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """One record's numbers, named `train/NAME` and `eval/NAME`."""

    def rewind(self, step: int) -> None:
        """Records after `step` are about to be written again (a rollback); a tracker that keeps
        every value may do nothing."""

    def close(self) -> None:
        """The end of this start (the run may be resumed later)."""


def names_of(writers) -> tuple:
    """`writers` as a tuple: a comma-separated string of names, one `Writer`, or an iterable of
    names and `Writer`s."""
    if isinstance(writers, Writer):
        return (writers,)
    if isinstance(writers, str):
        return tuple(name.strip() for name in writers.split(",") if name.strip())
    return tuple(writers)


def check_writers(writers, key: str = "writers") -> tuple:
    """The writers as a tuple, each a known name whose package imports, or a `Writer`; else a
    ConfigError naming `key` and the fix (the extra to install)."""
    if not isinstance(writers, Writer | str | Iterable):
        raise ConfigError(
            f"{key} must be names ({', '.join(BUILT_IN)}) or Writers, got {writers!r}"
        )
    writers = names_of(writers)
    for writer in writers:
        if isinstance(writer, Writer):
            continue
        if not isinstance(writer, str) or writer not in BUILT_IN:
            raise ConfigError(
                f"{key} names {writer!r}, which is no tracker; use {', '.join(BUILT_IN)}, or "
                "pass an object with write_config, write, rewind and close"
            )
        _, package, extra = BUILT_IN[writer]
        if package and importlib.util.find_spec(package) is None:  # found, not imported
            raise ConfigError(
                f"{key} names {writer!r}, whose package {package} is not installed; "
                f"pip install 'jddp[{extra}]'"
            )
        module = _module(writer)
        if hasattr(module, "check_environment"):  # settings the tracker reads, where it has any
            module.check_environment()
    return writers


def open_writers(writers, workdir: str, start_step: int) -> list[Writer]:
    """The `Writer`s of `writers` (checked by `check_writers`): built-in names opened on
    `workdir` at `start_step`, given objects as they are."""
    opened = []
    try:
        for writer in writers:
            if isinstance(writer, str):
                writer = _module(writer).open_writer(workdir, start_step)
            opened.append(writer)
    except BaseException:
        for writer in opened:
            writer.close()
        raise
    return opened


def _module(name: str):
    """The module of built-in tracker `name` (its package imported only when it opens)."""
    return importlib.import_module(f"jddp.observe.{BUILT_IN[name][0]}")


def scalars(record: Mapping) -> dict[str, float]:
    """The numbers of a `metrics.jsonl` record, as trackers name them: `eval_NAME` as
    `eval/NAME`, every other as `train/NAME` (notes that are not numbers stay out)."""
    return {
        f"eval/{name[5:]}" if name.startswith("eval_") else f"train/{name}": value
        for name, value in record.items()
        if name != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


def flat_config(config: Mapping, prefix: str = "") -> dict:
    """`config` with nested mappings joined into dotted keys (`parallel.strategy`), as trackers
    with flat parameters (MLflow) hold them."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat |= flat_config(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def stored_run_id(workdir: str, tracker: str) -> str | None:
    """The id of the tracker run this workdir's earlier starts wrote to, or None."""
    try:
        with open(os.path.join(workdir, RUN_IDS)) as f:
            run_id = json.load(f).get(tracker)
    except (OSError, ValueError, AttributeError):  # none yet, or torn: a new tracker run
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def store_run_id(workdir: str, tracker: str, run_id: str) -> None:
    """Records `run_id` as the workdir's `tracker` run (the file is replaced whole)."""
    path = os.path.join(workdir, RUN_IDS)
    try:
        with open(path) as f:
            ids = json.load(f)
        ids = ids if isinstance(ids, dict) else {}
    except (OSError, ValueError):
        ids = {}
    atomic_write.write_json(path, ids | {tracker: run_id}, indent=2)


def project_name(variable: str) -> str:
    """The tracker's environment variable `variable` (its project, or experiment), else "jddp"."""
    return os.environ.get(variable) or "jddp"
