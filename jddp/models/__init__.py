"""Built-in Flax models, by the name a config's `model` gives them."""

import dataclasses
import difflib

import flax.linen as nn

from jddp.errors import ConfigError
from jddp.models.cnn import CNN
from jddp.models.mlp import MLP

MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn": CNN}


def create_model(name: str, num_classes: int, **model_args) -> nn.Module:
    """The model `name` with `num_classes` outputs; `model_args` are its other fields."""
    if name not in MODELS:
        close = difflib.get_close_matches(name, MODELS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown model {name!r}{hint}; choose one of {', '.join(sorted(MODELS))}"
        )
    cls = MODELS[name]
    fields = {f.name for f in dataclasses.fields(cls)} - {"parent", "name", "num_classes"}
    unknown = sorted(set(model_args) - fields)
    if unknown:
        raise ConfigError(
            f"model {name!r} has no argument {', '.join(unknown)}; its arguments are "
            f"{', '.join(sorted(fields))} (set them under config.model_args)"
        )
    return cls(num_classes=num_classes, **model_args)
