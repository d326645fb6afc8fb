"""Whether a model can take a dataset's examples, found out before anything is trained or written.

The real failures: a convolutional model fed token sequences breaks deep inside Flax ("operands
could not be broadcast"), and a model whose pooling shrinks small images to nothing fails in its
initializer (ZeroDivisionError) or gets weight matrices with no rows. Initializing the model
abstractly (`jax.eval_shape`, no compute) on one real example turns each into one line.
"""

import dataclasses
import math

import jax
import numpy as np

from jddp.core.task import Task
from jddp.errors import ConfigError, DataError


def check_model_fits(task: Task, sample_batch, model_name: str, dataset_name: str) -> None:
    """Raises ConfigError for a layer of no width, and DataError if `task`'s model cannot take
    `sample_batch`'s input, each in one line."""
    _check_sizes(task.model, model_name)
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


def _check_sizes(model, model_name: str) -> None:
    """Integer fields (and tuples of them) of a Linen model are sizes: none may be below 1, and
    none below 0 where the field's own default is 0 (a "derive it" value, like GPT's mlp_dim)."""
    if not dataclasses.is_dataclass(model):
        return
    for field in dataclasses.fields(model):
        value = getattr(model, field.name, None)
        values = value if isinstance(value, tuple | list) else (value,)
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            continue
        lowest = 0 if field.default == 0 else 1
        if min(values) < lowest:
            raise ConfigError(
                f"model_args.{field.name}={value!r} of model {model_name!r} has a size below "
                f"{lowest}: a layer needs at least one unit; set --config.model_args.{field.name}"
            )
