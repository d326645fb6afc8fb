"""`TrainState`: everything one training step reads and writes, as a pytree of arrays."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jddp.core.tree_paths import path_str
from jddp.errors import ShapeError


class TrainState(struct.PyTreeNode):
    """The model's parameters, optimizer state and mutable collections at one step.

    `model_state` holds non-trained collections such as `batch_stats` (empty dict if none);
    `rng` is raw PRNG key data: the key for step `s` is `fold_in(rng, s)`;
    `nonfinite_steps` counts the steps whose loss or gradients were not finite;
    `loss_scale` is float16 training's dynamic loss scale (`{"scale", "good_steps"}`, see
    jddp/core/loss_scale.py), an empty dict otherwise.
    `comm_state` is the gradient communication's own state (PowerSGD's error feedback and
    warm-started factors, see jddp/parallel/grad_reduction.py), an empty dict without compression.
    `layer_order` (static): None when a `Pipelined` stack's layers (and their optimizer state)
    are in the model's order; (S, V) when an interleaved pipeline of S stages and V repeats
    holds them in its stages' order (jddp/core/layer_stacks.py).
    `Trainer.host_state` and checkpoints always give the model's order.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    nonfinite_steps: jax.Array
    loss_scale: Any = struct.field(default_factory=dict)
    comm_state: Any = struct.field(default_factory=dict)
    layer_order: tuple[int, int] | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls, params, opt_state, model_state, rng, loss_scale=None, comm_state=None
    ) -> "TrainState":
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            rng=rng,
            nonfinite_steps=jnp.zeros((), jnp.int32),
            loss_scale={} if loss_scale is None else loss_scale,
            comm_state={} if comm_state is None else comm_state,
        )

    def step_key(self) -> jax.Array:
        """The PRNG key for the current step (dropout and other stochastic layers)."""
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)


def arranged_like(tree, given, what: str):
    """The leaves of `given` (host arrays) in `tree`'s structure and dtypes, matched by path
    ("Dense_0/kernel", "0/mu/Dense_0/kernel"), so a tuple saved as a list or a namedtuple as a dict
    still fits. A ShapeError names the first path that is missing, extra or of another shape."""
    found = {path_str(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(given)}
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = []
    for path, leaf in paths:
        name = path_str(path)
        if name not in found:
            raise ShapeError(f"{what} has no {name!r} (the model's has shape {leaf.shape})")
        value = found.pop(name)
        if not getattr(value, "lazy", False):  # lazy leaves read their values when indexed
            value = np.asarray(value)
        if value.shape != tuple(leaf.shape):
            raise ShapeError(
                f"{what}'s {name!r} has shape {value.shape}, the model's {tuple(leaf.shape)}"
            )
        leaves.append(value.astype(leaf.dtype, copy=False))
    if found:
        name, extra = next(iter(found.items()))
        raise ShapeError(f"{what} has {name!r} (shape {np.shape(extra)}) that the model lacks")
    return jax.tree_util.tree_unflatten(treedef, leaves)
