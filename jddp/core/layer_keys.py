"""The random key of the layer a model is running, for code that runs inside the layer without
being written into it (LoRA's adapters, jddp/core/lora.py).

jddp's decoders hand layer i the key `fold_in(layer_key, i)` whether the layers are unrolled,
stacked (`nn.scan`) or split into pipeline stages, so a layer draws the same numbers in every
layout. A module's own `dropout` stream does not: Linen derives it from the module's path and the
transform around it, which differ between those layouts. A layer runs its body within
`running(key, path)`; code inside it asks `key_for(module)` for a key of its own, folded from the
layer's key by its module path within the layer. A model asks `wanted()` whether code inside its
layers draws (it then derives layer keys even with its own dropout off).
"""

import contextlib
import contextvars
import dataclasses
import zlib

import jax
from flax import linen as nn


@dataclasses.dataclass(frozen=True)
class _Layer:
    key: jax.Array
    path: tuple[str, ...]


_RUNNING: contextvars.ContextVar = contextvars.ContextVar("jddp_running_layer", default=None)
_WANTED: contextvars.ContextVar = contextvars.ContextVar("jddp_layer_keys_wanted", default=False)


@contextlib.contextmanager
def running(key: jax.Array | None, path: tuple[str, ...]):
    """Within it, the modules under `path` belong to a layer whose key is `key` (None: the
    layer has none, as outside training)."""
    token = _RUNNING.set(None if key is None else _Layer(key, tuple(path)))
    try:
        yield
    finally:
        _RUNNING.reset(token)


@contextlib.contextmanager
def wanting(wanted: bool = True):
    """Within it, `wanted()` says `wanted`: something inside the layers draws from their keys."""
    token = _WANTED.set(wanted)
    try:
        yield
    finally:
        _WANTED.reset(token)


def wanted() -> bool:
    """Whether code inside the layers draws from their keys (a model then derives them)."""
    return _WANTED.get()


def key_for(module: nn.Module) -> jax.Array | None:
    """`module`'s key inside the running layer: `fold_in(layer key, crc32(path))`, the path
    being the module's within the layer (`attn/q`), slash-separated; None outside a layer that
    has a key."""
    layer = _RUNNING.get()
    path = tuple(str(part) for part in module.path)
    if layer is None or path[: len(layer.path)] != layer.path:
        return None
    within = "/".join(path[len(layer.path) :])
    return jax.random.fold_in(layer.key, zlib.crc32(within.encode()))
