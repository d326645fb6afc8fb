"""Datasets (TFDS random-access sources, or own files and functions: `npz:PATH`, `jsonl:PATH`,
`parquet:PATH`, `hf:PATH`, `package.module:function`) and grain pipelines that batch them."""

from jddp.data.cache import ArraySource
from jddp.data.datasets import (
    CLASSIFICATION,
    DATASETS,
    LANGUAGE_MODEL,
    DataOptions,
    Dataset,
    DatasetSpec,
    get_dataset,
    open_dataset,
)
from jddp.data.loader import TrainBatches, eval_batches, train_batches
from jddp.data.padding import pad_batch
from jddp.data.prefetch import DevicePrefetch, prefetch_to_device
from jddp.data.tokenizer import TextTokenizer, load_tokenizer

__all__ = [
    "ArraySource",
    "CLASSIFICATION",
    "DATASETS",
    "LANGUAGE_MODEL",
    "DataOptions",
    "Dataset",
    "DatasetSpec",
    "DevicePrefetch",
    "TextTokenizer",
    "TrainBatches",
    "eval_batches",
    "get_dataset",
    "load_tokenizer",
    "open_dataset",
    "pad_batch",
    "prefetch_to_device",
    "train_batches",
]
