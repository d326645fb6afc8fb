"""`TrainState`: everything one training step reads and writes, as a pytree of arrays."""

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


class TrainState(struct.PyTreeNode):
    """The model's parameters, optimizer state and mutable collections at one step.

    `model_state` holds non-trained collections such as `batch_stats` (empty dict if none);
    `rng` is raw PRNG key data: the key for step `s` is `fold_in(rng, s)`;
    `nonfinite_steps` counts the steps whose loss or gradients were not finite;
    `comm_state` is the gradient communication's own state (PowerSGD's error feedback and
    warm-started factors, see jddp/strategies/compression.py), an empty dict without compression.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    nonfinite_steps: jax.Array
    comm_state: Any = struct.field(default_factory=dict)

    @classmethod
    def create(cls, params, opt_state, model_state, rng, comm_state=None) -> "TrainState":
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            rng=rng,
            nonfinite_steps=jnp.zeros((), jnp.int32),
            comm_state={} if comm_state is None else comm_state,
        )

    def step_key(self) -> jax.Array:
        """The PRNG key for the current step (dropout and other stochastic layers)."""
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)
