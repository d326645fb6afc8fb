"""`TrainState`: everything one training step reads and writes, as a pytree of arrays."""

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


class TrainState(struct.PyTreeNode):
    """The model's parameters, optimizer state and mutable collections at one step.

    `model_state` holds non-trained collections such as `batch_stats` (empty dict if none);
    `rng` is raw PRNG key data: the key for step `s` is `fold_in(rng, s)`;
    `nonfinite_steps` counts the steps whose loss or gradients were not finite.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    nonfinite_steps: jax.Array

    @classmethod
    def create(cls, params, opt_state, model_state, rng) -> "TrainState":
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            rng=rng,
            nonfinite_steps=jnp.zeros((), jnp.int32),
        )

    def step_key(self) -> jax.Array:
        """The PRNG key for the current step (dropout and other stochastic layers)."""
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)
