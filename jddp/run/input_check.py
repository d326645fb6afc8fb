"""Whether a model can take a dataset's examples, found out before anything is trained or written.

The real failures: a convolutional model fed token sequences breaks deep inside Flax ("operands
could not be broadcast"), and a model whose pooling shrinks small images to nothing fails in its
initializer (ZeroDivisionError) or gets weight matrices with no rows. Initializing the model
abstractly (`jax.eval_shape`, no compute) on one real example turns each into one line. An own
model that sets its outputs itself is held to the dataset's classes (or vocabulary) the same way:
with fewer, the loss of an example past its last output is NaN (classification) or, for a
language model, finite and wrong: it trains on without a word.
"""

import dataclasses
import math

import jax
import numpy as np

from jddp.core.task import Task
from jddp.data import LANGUAGE_MODEL, DatasetSpec
from jddp.errors import ConfigError, DataError, JddpError
from jddp.models.user_models import OUTPUT_FIELD, is_import_path


def check_model_takes_data(
    task: Task, sample_batch, model_name: str, dataset_name: str, dataset: DatasetSpec | None = None
) -> None:
    """Raises ConfigError for a layer of no width, and DataError if `task`'s model cannot take
    `sample_batch`'s input, each in one line; given the `dataset`, also a ConfigError for an own
    model with fewer outputs than its classes or vocabulary (`check_outputs`)."""
    _check_sizes(task.model, model_name)
    sample = np.asarray(sample_batch[task.inputs.entries[0]])
    inputs = {entry: np.asarray(sample_batch[entry])[:1] for entry in task.inputs.entries}
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
        state = jax.eval_shape(task.init_state, jax.random.key(0), inputs)
    except JddpError as e:  # jddp's own models say what to change themselves
        raise DataError(f"{what}: {e}") from None
    except Exception as e:  # any other failure here is the model rejecting the input
        line = (str(e).strip().splitlines() or [""])[0][:160]
        raise DataError(f"{what}: {type(e).__name__}: {line}; {hint}") from None
    empty = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]
        if math.prod(leaf.shape) == 0
    ]
    if empty:
        raise DataError(f"{what}: parameter {empty[0]} would be empty; {hint}")
    if dataset is not None and is_import_path(model_name):
        check_outputs(task, state, sample_batch, model_name, dataset_name, dataset)


def check_outputs(
    task: Task, state, sample_batch, model_name: str, dataset_name: str, dataset: DatasetSpec
) -> None:
    """A ConfigError if the last axis of the model's output (from shapes: nothing is computed)
    is shorter than `dataset`'s classes or vocabulary. Built-in models get their outputs from
    the dataset; an own model that takes no `num_outputs` argument decides them itself."""
    batch = {name: np.asarray(value)[:1] for name, value in sample_batch.items()}
    try:
        outputs = jax.eval_shape(
            lambda params, model_state: task.forward(params, model_state, batch, train=False)[0],
            state.params,
            state.model_state,
        )
    except Exception:  # e.g. collectives over the mesh's axes: the strategy's step will tell
        return
    if not isinstance(outputs, jax.ShapeDtypeStruct) or not outputs.shape:
        return  # not one array of scores: nothing to compare
    given, needed = outputs.shape[-1], dataset.num_classes
    if given >= needed:
        return
    counted = (
        f"the {needed} tokens of {dataset_name}'s vocabulary"
        if dataset.kind == LANGUAGE_MODEL
        else f"the {needed} classes of {dataset_name}"
    )
    raise ConfigError(
        f"model {model_name!r} gives {given} outputs per example (the last axis of its output), "
        f"fewer than {counted}; give the model a {OUTPUT_FIELD} argument (jddp passes it "
        f"{needed}) or make it give at least {needed} outputs"
    )


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
