"""Padding a ragged batch to a fixed size, with a `mask` so padded rows count for nothing."""

from collections.abc import Mapping

import numpy as np

from jddp.errors import ShapeError


def pad_batch(batch: Mapping[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """`batch` with every array zero-padded to `size` rows and `mask` = 1 for real rows."""
    arrays = {name: np.asarray(x) for name, x in batch.items()}
    rows = {len(x) for x in arrays.values()}
    if len(rows) != 1:
        raise ShapeError(f"batch arrays disagree on the number of examples: {sorted(rows)}")
    (n,) = rows
    if n > size:
        raise ShapeError(f"a batch of {n} examples is larger than the padded size {size}")
    arrays.setdefault("mask", np.ones(n, np.float32))
    return {
        name: np.concatenate([x, np.zeros((size - n, *x.shape[1:]), x.dtype)]) if n < size else x
        for name, x in arrays.items()
    }
