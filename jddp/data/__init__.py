"""Datasets (TFDS random-access sources) and grain pipelines that batch them."""

from jddp.data.datasets import DATASETS, DatasetSpec, get_dataset, open_splits
from jddp.data.padding import pad_batch
from jddp.data.pipeline import eval_batches, train_batches
from jddp.data.prefetch import prefetch_to_device

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "eval_batches",
    "get_dataset",
    "open_splits",
    "pad_batch",
    "prefetch_to_device",
    "train_batches",
]
