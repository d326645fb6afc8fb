"""Built-in Flax models, by the name a config's `model` gives them."""

import dataclasses
import difflib

import flax.linen as nn

from jddp.errors import ConfigError
from jddp.models.cnn import CNN
from jddp.models.gpt import GPT
from jddp.models.mlp import MLP
from jddp.models.resnet import ResNet

MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn": CNN, "resnet": ResNet, "gpt": GPT}
# The field that receives the dataset's number of outputs (classes, or the vocabulary size).
OUTPUT_FIELDS = {"gpt": "vocab_size"}


def create_model(
    name: str,
    num_outputs: int,
    *,
    batch_axis_name: str | tuple[str, ...] | None = None,
    **model_args,
) -> nn.Module:
    """The model `name` with `num_outputs` outputs; `model_args` are its other fields.

    `model_args` may ask for more outputs than the dataset has (a vocabulary padded to a multiple
    of 64, say), never fewer. `batch_axis_name` goes to models with BatchNorm (ResNet); pass the
    strategy's, `jddp.batch_axis_name(strategy, mesh)`.
    """
    if name not in MODELS:
        close = difflib.get_close_matches(name, MODELS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown model {name!r}{hint}; choose one of {', '.join(sorted(MODELS))}"
        )
    cls = MODELS[name]
    output_field = OUTPUT_FIELDS.get(name, "num_classes")
    fields = {f.name for f in dataclasses.fields(cls)} - {"parent", "name", "batch_axis_name"}
    unknown = sorted(set(model_args) - fields)
    if unknown:
        raise ConfigError(
            f"model {name!r} has no argument {', '.join(unknown)}; its arguments are "
            f"{', '.join(sorted(fields))} (set them under config.model_args)"
        )
    outputs = model_args.pop(output_field, num_outputs)
    if outputs < num_outputs:
        raise ConfigError(
            f"model_args.{output_field}={outputs} is smaller than the dataset's {num_outputs}; "
            f"remove it or raise it to at least {num_outputs}"
        )
    if "batch_axis_name" in {f.name for f in dataclasses.fields(cls)}:
        model_args["batch_axis_name"] = batch_axis_name
    return cls(**{output_field: outputs}, **model_args)
