"""One functional interface over Flax Linen and Flax NNX modules, so the core treats them alike.

`as_functional(model)` gives an object with
  `init(rngs, args, kwargs) -> (params, model_state)` and
  `apply(params, model_state, args, kwargs, *, train, rng) -> (outputs, model_state)`,
and `apply_sown(...)`, which also returns what a Linen module sowed (jddp/core/sown.py);
where `params` and `model_state` are plain nested dicts of arrays (the same paths for both kinds:
`{"dense": {"kernel": ...}}`), so optimizers, sharding rules and checkpoints never see which kind
of module is training. `args` / `kwargs` are the model's own inputs (`ModelInputs` picks them from
a batch); a `__call__` that takes `train` gets it, one that takes `deterministic` gets `not train`
(dropout on in training, off in eval), and an NNX `__call__` that takes `rngs` gets an `nnx.Rngs`.

`axis_aliases` binds the axis names a module's layers reduce over to the strategy's: a pmap-era
`nn.BatchNorm(axis_name="batch")` synchronizes over a mesh's `data` and `fsdp` axes unchanged.
"""

import contextlib
import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jddp.core import sown
from jddp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """The batch entries a model's `__call__` gets, from `input_key`: `"image"` (one positional
    input), `("tokens", "segments")` (positional inputs in this order) or `{"inputs": "tokens",
    "mask": "attention_mask"}` (call argument -> batch entry, passed by keyword)."""

    positional: tuple[str, ...]
    keywords: tuple[tuple[str, str], ...]  # (call argument, batch entry)
    input_key: Any

    @classmethod
    def parse(cls, input_key) -> "ModelInputs":
        if isinstance(input_key, str):
            return cls((input_key,), (), input_key)
        names = list(input_key.items()) if isinstance(input_key, Mapping) else input_key
        if isinstance(input_key, Mapping) and names and all(_is_names(pair) for pair in names):
            return cls((), tuple(names), input_key)
        if isinstance(input_key, tuple | list) and names and _is_names(names):
            return cls(tuple(input_key), (), input_key)
        raise ConfigError(
            f"input_key must name the batch entry the model takes ('image'), a tuple of entries "
            f"for positional inputs, or a dict of call argument -> entry; got {input_key!r}"
        )

    @property
    def entries(self) -> tuple[str, ...]:
        """The batch entries the model reads, positional ones first."""
        return self.positional + tuple(entry for _, entry in self.keywords)

    def call_args(self, batch) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of the model's `__call__` from `batch`."""
        args = tuple(batch[entry] for entry in self.positional)
        return args, {argument: batch[entry] for argument, entry in self.keywords}

    def check_fits(self, module) -> None:
        """A ConfigError now, rather than a TypeError in the first step, if `module`'s
        `__call__` cannot take these arguments."""
        signature = inspect.signature(type(module).__call__)
        try:
            signature.bind_partial(module, *self.positional, **dict(self.keywords))
        except TypeError as e:
            raise ConfigError(
                f"input_key={self.input_key!r} does not fit {type(module).__name__}.__call__"
                f"{signature} ({e}); name its inputs, e.g. input_key={{'inputs': 'tokens'}}"
            ) from None


def _is_names(values) -> bool:
    return all(isinstance(v, str) for v in values)


def _call_parameters(module) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(type(module).__call__).parameters


def _mode_arguments(parameters, train: bool) -> dict:
    """`train=` and `deterministic=` for a `__call__` that takes them."""
    mode = {"train": train, "deterministic": not train}
    return {name: value for name, value in mode.items() if name in parameters}


def _bound_axis_name(name, aliases: Mapping[str, Any]):
    """`name` (an axis name or a tuple of them) with every alias replaced by what it means."""
    if isinstance(name, str):
        return aliases.get(name, name)
    if isinstance(name, tuple) and any(n in aliases for n in name):
        bound = []
        for n in name:
            meant = aliases.get(n, n)
            bound.extend(meant if isinstance(meant, tuple) else (meant,))
        return tuple(bound)
    return name


class LinenModule:
    """A Linen module: parameters in `params`, mutable collections (`batch_stats`, ...) as state.

    Stochastic layers draw from the `dropout` RNG stream.
    """

    def __init__(self, module: nn.Module, axis_aliases: Mapping[str, Any]):
        self.module = module
        self._parameters = _call_parameters(module)
        self._aliases = dict(axis_aliases)

    def _bind_axis_names(self, next_fun, args, kwargs, context):
        """A method interceptor: layers whose `axis_name` is an alias reduce over its axes.
        It rebinds the module instance bound to this apply, never the user's own."""
        module = context.module
        name = getattr(module, "axis_name", None)
        if name is not None:
            bound = _bound_axis_name(name, self._aliases)
            if bound is not name:
                object.__setattr__(module, "axis_name", bound)
        return next_fun(*args, **kwargs)

    def init(self, rngs: dict[str, jax.Array], args, kwargs) -> tuple[Any, dict]:
        mode = _mode_arguments(self._parameters, False)
        variables = dict(self.module.init(rngs, *args, **kwargs, **mode))
        for name in sown.COLLECTIONS:  # reports of a step, not state
            variables.pop(name, None)
        return variables.pop("params"), variables

    def apply(self, params, model_state, args, kwargs, *, train: bool, rng=None):
        return self.apply_sown(params, model_state, args, kwargs, train=train, rng=rng)[:2]

    def apply_sown(self, params, model_state, args, kwargs, *, train: bool, rng=None):
        """`apply`'s (outputs, model_state), and in training what the module sowed into
        jddp/core/sown.py's collections ({} in evaluation)."""
        with self.binding_axes():
            return self._apply(params, model_state, args, kwargs, train=train, rng=rng)

    def binding_axes(self):
        """The context in which layers whose `axis_name` is an alias reduce over its axes (the
        pipeline engine applies the model's layers one by one within it)."""
        if self._aliases:
            return nn.intercept_methods(self._bind_axis_names)
        return contextlib.nullcontext()

    def _apply(self, params, model_state, args, kwargs, *, train: bool, rng):
        variables = {"params": params, **model_state}
        options = {"rngs": {"dropout": rng} if rng is not None else None}
        options.update(kwargs, **_mode_arguments(self._parameters, train))
        if not train:
            return self.module.apply(variables, *args, **options), model_state, {}
        mutable = list(model_state) + list(sown.COLLECTIONS)
        outputs, updated = self.module.apply(variables, *args, mutable=mutable, **options)
        updated = dict(updated)
        reports = {name: updated.pop(name) for name in sown.COLLECTIONS if name in updated}
        return outputs, updated, reports


def _mode_view(module: nnx.Module, train: bool) -> nnx.Module:
    """`module` with Dropout / BatchNorm (and any module with these attributes) in train or eval
    mode; shares the module's variables."""
    attributes = {"deterministic": not train, "use_running_average": not train}
    if hasattr(nnx, "view"):
        return nnx.view(module, raise_if_not_found=False, **attributes)
    copy = nnx.merge(*nnx.split(module))  # older flax: set the attributes on a copy
    copy.set_attributes(raise_if_not_found=False, **attributes)
    return copy


class _StateCodec:
    """Converts one `nnx.State` between NNX's form (Variable nodes) and a plain nested dict."""

    def __init__(self, state: nnx.State):
        self._treedef = jax.tree.structure(state)
        self.pure = nnx.to_pure_dict(state)
        pure_leaves, state_leaves = jax.tree.leaves(self.pure), jax.tree.leaves(state)
        same_order = len(pure_leaves) == len(state_leaves) and all(
            a is b for a, b in zip(pure_leaves, state_leaves, strict=True)
        )
        if not same_order:  # to_state relies on it
            raise AssertionError("nnx.to_pure_dict changed the order of the leaves")

    def to_state(self, pure: dict) -> nnx.State:
        return jax.tree.unflatten(self._treedef, jax.tree.leaves(pure))


class NnxModule:
    """An NNX module instance, taken apart once into a graph definition and its variables.

    Parameters (`nnx.Param`) are the instance's own: initialize them with your `nnx.Rngs`; jddp's
    seed drives the RNG streams (dropout) only. `nnx.BatchStat` variables become
    `model_state["batch_stats"]`, any other non-parameter variables `model_state["variables"]`.
    Train and eval mode are set the NNX way (`deterministic` / `use_running_average`, as
    `module.train()` / `module.eval()` do), as well as by `train=` / `deterministic=` where
    `__call__` takes them. Every RNG stream of the module is reseeded from the step's key on each
    training step; a `__call__` that takes `rngs` (the Flax NNX MNIST example's
    `model(x, rngs=rngs)`) gets an `nnx.Rngs` drawn from it too.
    """

    def __init__(self, module: nnx.Module, axis_aliases: Mapping[str, Any]):
        self._parameters = _call_parameters(module)
        if axis_aliases:  # on a copy: the user's module keeps its own axis names
            module = nnx.clone(module)
            for _, node in nnx.iter_graph(module):
                name = getattr(node, "axis_name", None)
                if isinstance(node, nnx.Module) and name is not None:
                    node.axis_name = _bound_axis_name(name, axis_aliases)
        self._graphdefs = {
            train: nnx.split(_mode_view(module, train))[0] for train in (True, False)
        }
        _, params, batch_stats, rng_state, other = _partition(module)
        self._params = _StateCodec(params)
        self._state = {"batch_stats": _StateCodec(batch_stats), "variables": _StateCodec(other)}
        self._state = {name: c for name, c in self._state.items() if c.pure}
        self._rng_state = rng_state
        streams = (node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.RngStream))
        self._rng_tags = sorted({stream.key.tag for stream in streams})

    def init(self, rngs, args, kwargs) -> tuple[dict, dict]:
        del rngs, args, kwargs  # the instance is already initialized
        return self._params.pure, {name: codec.pure for name, codec in self._state.items()}

    def apply_sown(self, params, model_state, args, kwargs, *, train: bool, rng=None):
        """`apply`'s results and an empty report: NNX modules sow nothing jddp reads yet."""
        return *self.apply(params, model_state, args, kwargs, train=train, rng=rng), {}

    def apply(self, params, model_state, args, kwargs, *, train: bool, rng=None):
        states = [self._params.to_state(params)]
        states += [self._state[name].to_state(model_state[name]) for name in self._state]
        # Fresh Variable objects, so reseeding below cannot write into the captured originals.
        states.append(jax.tree.map(lambda x: x, self._rng_state))
        module = nnx.merge(self._graphdefs[train], *states)
        if rng is not None and self._rng_tags:
            keys = {tag: jax.random.fold_in(rng, i) for i, tag in enumerate(self._rng_tags)}
            nnx.reseed(module, **keys)
        options = dict(kwargs, **_mode_arguments(self._parameters, train))
        if "rngs" in self._parameters:  # eval is deterministic: any fixed key will do
            options["rngs"] = nnx.Rngs(rng if rng is not None else jax.random.key(0))
        outputs = module(*args, **options)
        if not train:
            return outputs, model_state
        _, _, batch_stats, _, other = _partition(module)
        updated = {"batch_stats": batch_stats, "variables": other}
        return outputs, {name: nnx.to_pure_dict(updated[name]) for name in self._state}


def _partition(module: nnx.Module):
    """(graphdef, params, batch_stats, rng_state, every other variable)."""
    return nnx.split(module, nnx.Param, nnx.BatchStat, nnx.RngState, ...)


def as_functional(model, axis_aliases: Mapping[str, Any] = ()) -> LinenModule | NnxModule:
    """The functional view of a Linen or NNX module; anything else is a ConfigError."""
    aliases = dict(axis_aliases)
    if isinstance(model, nn.Module):
        return LinenModule(model, aliases)
    if isinstance(model, nnx.Module):
        return NnxModule(model, aliases)
    raise ConfigError(
        f"model must be a flax.linen.Module or a flax.nnx.Module instance, got "
        f"{type(model).__name__}; pass an instance such as MyNet() or MyNet(rngs=nnx.Rngs(0))"
    )
