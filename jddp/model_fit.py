"""Whether a model can take a dataset's examples, found out before anything is trained or written.

The real failures: a convolutional model fed token sequences breaks deep inside Flax ("operands
could not be broadcast"), and a model whose pooling shrinks small images to nothing fails in its
initializer (ZeroDivisionError) or gets weight matrices with no rows. Initializing the model
abstractly (`jax.eval_shape`, no compute) on one real example turns each into one line.
"""

import math

import jax
import numpy as np

from jddp.core import Task
from jddp.errors import DataError


def check_model_fits(task: Task, sample_batch, model_name: str, dataset_name: str) -> None:
    """Raises DataError, in one line, if `task`'s model cannot take `sample_batch`'s input."""
    sample = np.asarray(sample_batch[task.input_key])
    what = (
        f"model {model_name!r} cannot take the {task.input_key!r} of {dataset_name} "
        f"({sample.dtype} {sample.shape[1:]} per example)"
    )
    if sample.ndim <= 2:
        hint = "it gives sequences, not images; choose a model for sequences"
    else:
        size = "x".join(map(str, sample.shape[1:-1]))
        hint = (
            f"choose a model built for {size} images, or fewer downsampling layers in "
            "config.model_args"
        )
    try:
        state = jax.eval_shape(task.init_state, jax.random.key(0), sample[:1])
    except Exception as e:  # any failure here is the model rejecting the input
        line = (str(e).strip().splitlines() or [""])[0][:160]
        raise DataError(f"{what}: {type(e).__name__}: {line}; {hint}") from None
    empty = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]
        if math.prod(leaf.shape) == 0
    ]
    if empty:
        raise DataError(f"{what}: parameter {empty[0]} would be empty; {hint}")
