"""Datasets by the name a config's `dataset` gives them, opened as TFDS random-access sources."""

import contextlib
import dataclasses
import difflib
import fcntl
import os
from collections.abc import Callable

import numpy as np
import tensorflow_datasets as tfds

from jddp.data.cache import InMemorySource
from jddp.data.digits import UciDigits
from jddp.errors import ConfigError


def scale_image(batch) -> dict[str, np.ndarray]:
    """A batch's uint8 pixels to float32 in [0, 1]; labels to int32."""
    return {
        "image": np.asarray(batch["image"], np.float32) / 255.0,
        "label": np.asarray(batch["label"], np.int32),
    }


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """How to build a dataset; `preprocess` maps a stacked batch of raw examples to model inputs."""

    builder_class: type[tfds.core.DatasetBuilder]
    num_classes: int
    image_shape: tuple[int, ...]
    preprocess: Callable[[dict], dict[str, np.ndarray]] = scale_image
    train_split: str = "train"
    eval_split: str = "test"


DATASETS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec(UciDigits, num_classes=10, image_shape=(8, 8, 1)),
}


def get_dataset(name: str) -> DatasetSpec:
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise ConfigError(
            f"unknown dataset {name!r}{hint}; choose one of {', '.join(sorted(DATASETS))}"
        )
    return DATASETS[name]


def default_data_dir() -> str:
    return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")


@contextlib.contextmanager
def _exclusive(path: str):
    """One preparer at a time per data dir, across processes (pytest workers, hosts' ranks)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def open_splits(spec: DatasetSpec, data_dir: str | None = None, cache_max_mb: float = 256):
    """(train, eval) random-access sources, preparing the dataset into `data_dir` on first use.

    A split no larger than `cache_max_mb` on disk is decoded once into memory: grain then reads
    it by index instead of decoding every example again each epoch.
    """
    data_dir = data_dir or default_data_dir()
    with _exclusive(os.path.join(data_dir, f".{spec.builder_class.name}.lock")):
        builder = spec.builder_class(data_dir=data_dir, file_format="array_record")
        builder.download_and_prepare()
    sources = builder.as_data_source()

    def open_split(split):
        small = builder.info.splits[split].num_bytes <= cache_max_mb * 2**20
        return InMemorySource(sources[split]) if small else sources[split]

    return open_split(spec.train_split), open_split(spec.eval_split)
