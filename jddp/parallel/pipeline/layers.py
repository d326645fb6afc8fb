"""`Pipelined(block, num_layers)`: a stack of identical blocks with stacked parameters, the part
of a model that pipeline parallelism splits into stages.

Outside a pipeline it is one `nn.scan` over the layers (parameters stacked along a leading axis of
length `num_layers`, under the block's own name). Under a mesh with a `stage` axis the pipeline
engine (jddp/parallel/pipeline/engine.py) runs the model in three parts: what comes before the stack
(embedding), the stack's layers split into stages, what comes after (head, loss). It takes the model
apart with `split_at_stack`: the same model code, run once with the stack replaced by "stop here and
give me your input" and once by "here is your output".
"""

import contextlib
import contextvars
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jddp.core import sown
from jddp.core.layer_stacks import Stack, stack_initialized
from jddp.errors import ConfigError


@dataclasses.dataclass
class StackCall:
    """What a stack was called with: its unbound block, the input, the extra arguments (such as
    `train`), where its stacked parameters live, its length, and the key its layers' keys are
    folded from (None: they draw from the `dropout` stream)."""

    block: nn.Module
    inputs: jax.Array
    args: tuple
    path: tuple[str, ...]
    num_layers: int
    layer_key: jax.Array | None = None


_SPLIT: contextvars.ContextVar = contextvars.ContextVar("jddp_pipeline_split", default=None)


class _Capture:
    def __init__(self):
        self.call: StackCall | None = None


@dataclasses.dataclass
class _Inject:
    outputs: Any


class Pipelined(nn.Module):
    """`num_layers` copies of `block` (a Linen module instance used as a template: each layer
    has its own parameters) applied in sequence: `x = block(x, *args)`. Parameters are stacked
    along a leading axis under the block's name (`Pipelined(Block(..., name="blocks"), 12)`
    gives `blocks/...` with leading dimension 12).

    Random numbers: with `layer_key`, layer i is called as `block(x, *args, fold_in(layer_key, i))`
    — the model derives `layer_key`, so its unrolled form can hand layer i the same key and both
    forms, and a pipeline, draw alike. Without it, each layer's `dropout` stream is split off."""

    block: nn.Module
    num_layers: int

    def __post_init__(self):
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ConfigError(f"Pipelined num_layers={self.num_layers!r} must be >= 1")
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *args, layer_key: jax.Array | None = None):
        if self.is_initializing():
            stack_initialized(Stack(tuple(self.block.path), self.num_layers))
        split = _SPLIT.get()
        if isinstance(split, _Capture) and not self.is_initializing():
            if split.call is not None:
                raise ConfigError("a pipelined model may hold one Pipelined stack, not several")
            block = self.block.clone(parent=None, name=None)
            split.call = StackCall(block, x, args, self.block.path, self.num_layers, layer_key)
            return x  # what follows runs on this, and is discarded
        if isinstance(split, _Inject) and not self.is_initializing():
            return split.outputs
        if layer_key is None:
            keys, body = None, lambda block, carry, _: (block(carry, *args), None)
        else:
            keys = jax.vmap(lambda i: jax.random.fold_in(layer_key, i))(jnp.arange(self.num_layers))
            body = lambda block, carry, key: (block(carry, *args, key), None)  # noqa: E731
        scan = nn.scan(
            body,
            # What the layers sow (jddp/core/sown.py) stacked by layer, as their parameters.
            variable_axes={"params": 0, **dict.fromkeys(sown.COLLECTIONS, 0)},
            split_rngs={"params": True, "dropout": True},
            length=self.num_layers,
        )
        x, _ = scan(self.block, x, keys)
        return x


@contextlib.contextmanager
def _split(mode):
    token = _SPLIT.set(mode)
    try:
        yield mode
    finally:
        _SPLIT.reset(token)


def capture_stack():
    """Within this context, a model's Pipelined stack records its call (`.call`) and passes
    its input through."""
    return _split(_Capture())


def inject_stack(outputs):
    """Within this context, a model's Pipelined stack returns `outputs` instead of running."""
    return _split(_Inject(outputs))
