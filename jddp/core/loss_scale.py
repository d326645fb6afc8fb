"""Dynamic loss scaling for float16 compute (the Flax ImageNet example's `half_precision` on GPUs
without bfloat16, PyTorch's GradScaler).

float16 flushes gradients below ~6e-8 to zero, so the loss is multiplied by a large scale before
the backward pass and the gradients divided by it after. A step whose scaled gradients overflow
(inf or NaN) is skipped and the scale halved; after `growth_interval` good steps in a row it
doubles. The scale and the count of good steps live in `TrainState.loss_scale`, so checkpoints
keep them and a resumed run goes on with the same scale.
"""

import dataclasses
import math

import jax.numpy as jnp

from jddp.errors import ConfigError

FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """How the loss scale moves. The defaults are PyTorch's GradScaler's and Flax's
    DynamicScale's (2^16, doubled after 2000 good steps, halved on an overflow); it never goes
    below `minimum_scale`, where an overflow is the model's and counts as a non-finite step."""

    initial_scale: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    minimum_scale: float = 1.0

    def __post_init__(self):
        checks = (
            ("minimum_scale", self.minimum_scale, 0 < self.minimum_scale < math.inf, "> 0"),
            (
                "initial_scale",
                self.initial_scale,
                self.minimum_scale <= self.initial_scale < math.inf,
                ">= minimum_scale",
            ),
            ("growth_factor", self.growth_factor, 1 < self.growth_factor < math.inf, "> 1"),
            ("backoff_factor", self.backoff_factor, 0 < self.backoff_factor < 1, "in (0, 1)"),
        )
        for name, value, ok, rule in checks:
            if not ok:
                raise ConfigError(f"DynamicLossScale {name} must be finite and {rule}, got {value}")
        if not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise ConfigError(
                f"DynamicLossScale growth_interval must be a positive integer, got "
                f"{self.growth_interval!r}"
            )

    def init(self) -> dict:
        """The state a run starts with: `{"scale", "good_steps"}`."""
        return {
            "scale": jnp.asarray(self.initial_scale, jnp.float32),
            "good_steps": jnp.zeros((), jnp.int32),
        }

    def at_minimum(self, state: dict):
        return state["scale"] <= self.minimum_scale

    def update(self, state: dict, finite) -> dict:
        """The state after a step whose scaled gradients were `finite` (a boolean scalar)."""
        good_steps = jnp.where(finite, state["good_steps"] + 1, 0)
        grow = good_steps >= self.growth_interval
        grown = jnp.minimum(state["scale"] * self.growth_factor, FLOAT32_MAX)
        lowered = jnp.maximum(state["scale"] * self.backoff_factor, self.minimum_scale)
        scale = jnp.where(finite, jnp.where(grow, grown, state["scale"]), lowered)
        return {"scale": scale, "good_steps": jnp.where(grow, 0, good_steps)}
