"""Your own model, named in a config as `"package.module:Name"`.

`Name` is a Flax Linen or NNX module class, or a function returning a module instance (entry-point
syntax: `module:attr.attr` reaches a nested attribute). It is built with `config.model_args` as
keyword arguments, plus what jddp fills in where the class or function declares it:
`num_outputs` (the dataset's number of outputs, unless model_args sets at least that many), `rngs`
(an `nnx.Rngs` of the config's seed: NNX modules initialize their own parameters), and the mesh
fields of built-in models (`batch_axis_name`, `tensor_axis`, `sequence_parallel`,
`scan_layers` under a stage axis). Each way this can go wrong is one ConfigError line.
"""

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
from flax import nnx

from jddp.errors import ConfigError
from jddp.runtime import user_code

OUTPUT_FIELD = "num_outputs"
_LINEN_OWN = {"parent", "name"}  # Linen dataclass fields that Flax sets itself


def is_import_path(name: str) -> bool:
    """Whether a config's `model` names an own model ("package.module:Name"), not a built-in."""
    return ":" in name


def load(spec: str) -> Any:
    """The object `spec` ("package.module:Name") names, imported; a ConfigError if it cannot be."""
    if not user_code.IMPORT_PATH.match(spec):
        raise ConfigError(
            f"model {spec!r} is neither a built-in name nor 'package.module:Name' (a module "
            "importable from the config file's directory or PYTHONPATH, and a class or function "
            "in it)"
        )
    return user_code.load(spec, f"model {spec!r}")


def create(
    spec: str,
    num_outputs: int,
    *,
    seed: int,
    mesh_fields: Mapping[str, Any],
    pipelined: bool,
    model_args: dict,
):
    """The module `spec` names, built with `model_args` and what jddp fills in (see the module
    docstring); `mesh_fields` are set only where the class or function declares them."""
    target = load(spec)
    kind = _kind(spec, target)
    accepted, required, open_ended = _parameters(target, kind)
    jddp_set = {"rngs", *mesh_fields}
    refused = sorted(set(model_args) & jddp_set)
    unknown = [] if open_ended else sorted(set(model_args) - accepted)
    if refused or unknown:
        takes = sorted(accepted - jddp_set)
        problem = (
            f"sets {', '.join(refused)}, which jddp sets itself"
            if refused
            else f"has no argument {', '.join(unknown)}"
        )
        raise ConfigError(
            f"model {spec!r} {problem}; its arguments are {', '.join(takes) or 'none'} (set them "
            "under config.model_args)"
        )
    if mesh_fields.get("sequence_parallel") and "sequence_parallel" not in accepted:
        raise ConfigError(
            f"parallel.sequence_parallel needs a model that takes a sequence_parallel argument, "
            f"and {spec!r} does not; set it to false"
        )
    kwargs = dict(model_args)
    if OUTPUT_FIELD in accepted:
        kwargs[OUTPUT_FIELD] = check_outputs(kwargs.get(OUTPUT_FIELD, num_outputs), num_outputs)
    kwargs |= {name: value for name, value in mesh_fields.items() if name in accepted}
    if pipelined and "scan_layers" in accepted:
        kwargs["scan_layers"] = True
    if "rngs" in accepted:
        kwargs["rngs"] = nnx.Rngs(seed)
    missing = [name for name in required if name not in kwargs]
    if missing:
        hint = (
            "" if OUTPUT_FIELD in accepted else f" (a {OUTPUT_FIELD} argument gets the dataset's)"
        )
        raise ConfigError(
            f"model {spec!r} needs {', '.join(missing)}; set "
            f"{', '.join(f'--config.model_args.{m}' for m in missing)}{hint}"
        )
    try:
        model = target(**kwargs)
    except Exception as e:  # the user's constructor refused the arguments: one line, with where
        shown = {k: v for k, v in kwargs.items() if k != "rngs"}
        raise ConfigError(
            f"model {spec!r} failed to build with {shown}: {user_code.brief(e)}; "
            "check config.model_args"
        ) from None
    if not isinstance(model, nn.Module | nnx.Module):
        raise ConfigError(
            f"model {spec!r} returned {type(model).__name__}, not a flax.linen.Module or "
            "flax.nnx.Module instance; return the module the function builds"
        )
    return model


def check_outputs(outputs, num_outputs: int, field: str = OUTPUT_FIELD) -> int:
    """`outputs` (model_args' own value, or the dataset's) if it is an integer of at least the
    dataset's `num_outputs`; else a ConfigError naming the field."""
    if not isinstance(outputs, int) or isinstance(outputs, bool):
        raise ConfigError(
            f"model_args.{field}={outputs!r} is not an integer; remove it (the dataset gives "
            f"{num_outputs}) or set a whole number of at least {num_outputs}"
        )
    if outputs < num_outputs:
        raise ConfigError(
            f"model_args.{field}={outputs} is smaller than the dataset's {num_outputs}; "
            f"remove it or raise it to at least {num_outputs}"
        )
    return outputs


def _kind(spec: str, target) -> str:
    """'linen', 'nnx' or 'function'; a ConfigError for anything that builds no Flax module."""
    if isinstance(target, type):
        if issubclass(target, nn.Module):
            return "linen"
        if issubclass(target, nnx.Module):
            return "nnx"
        raise ConfigError(
            f"model {spec!r} is the class {target.__name__}, which is not a flax.linen.Module or "
            "flax.nnx.Module subclass; name a Flax module class or a function returning a module"
        )
    if isinstance(target, nn.Module | nnx.Module):
        raise ConfigError(
            f"model {spec!r} is a module instance; name its class, or a function that builds it, "
            "so that jddp can pass model_args, the number of outputs and the mesh's axis names"
        )
    if not callable(target):
        what = (
            "a Python module"
            if inspect.ismodule(target)
            else f"an object of type {type(target).__name__}"
        )
        raise ConfigError(
            f"model {spec!r} is {what}, not a Flax module class or a function returning a "
            "module; name the class or function after the ':'"
        )
    return "function"


def _parameters(target, kind: str) -> tuple[set[str], list[str], bool]:
    """(the keyword arguments `target` takes, those without a default, whether it takes any
    keyword at all through **kwargs)."""
    if kind == "linen":  # a dataclass: its fields, less the two Flax sets itself
        fields = [f for f in dataclasses.fields(target) if f.init and f.name not in _LINEN_OWN]
        required = [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        return {f.name for f in fields}, required, False
    signature = inspect.signature(target.__init__ if kind == "nnx" else target)
    parameters = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
    ]
    open_ended = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    required = [p.name for p in parameters if p.default is p.empty]
    return {p.name for p in parameters}, required, open_ended
