"""Per-example losses and metrics as weighted means that stay exact however a global batch is split
over devices and micro-batches.

A loss or metric function gives one value per example, or a pair (weighted sums, weights) per
example (a sequence's token-weighted loss and its token count, as the Flax nlp_seq example
computes them); plain values are weighted by the batch entry `weight_key` names, if any. Its
mean over the global batch is sum(weighted sums) / sum(weights): `Totals` carries both sums, so
averaging them over micro-batches and devices, then dividing, gives exactly that, where a mean
of per-device means would not (and would be NaN where a device's examples weigh nothing).
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jddp.errors import ShapeError

# (model outputs, batch) -> values, or (weighted sums, weights); each of shape (batch,).
PerExampleFn = Callable[[Any, Mapping[str, jax.Array]], jax.Array | tuple[jax.Array, jax.Array]]


def weighted_values(
    fns: Mapping[str, PerExampleFn], outputs, batch, rows: int, weight_key: str | None
) -> dict[str, tuple[jax.Array, jax.Array | None]]:
    """Each of `fns` on `outputs` as per-example float32 (weighted values, weights): a pair the
    function returned as it is, plain values times `batch[weight_key]`; weights None where
    neither weighs. A ShapeError names a function that does not give `rows` values."""
    given = batch[weight_key] if weight_key else None
    results = {}
    for name, fn in fns.items():
        value = fn(outputs, batch)
        paired = isinstance(value, tuple)
        if paired and len(value) != 2:
            raise ShapeError(
                f"{name} must give per-example values or a (weighted sums, weights) pair, got a "
                f"tuple of {len(value)}"
            )
        value, weight = value if paired else (value, given)
        parts = {name: value} | ({f"{name}'s weights": weight} if weight is not None else {})
        for what, part in parts.items():
            if jnp.shape(part) != (rows,):
                raise ShapeError(
                    f"{what} must give one value per example, shape ({rows},), got shape "
                    f"{jnp.shape(part)}; return per-example values, not their mean"
                )
        value = jnp.asarray(value, jnp.float32)
        if weight is not None:
            weight = jnp.asarray(weight, jnp.float32)
            value = value if paired else value * weight
        results[name] = (value, weight)
    return results


class Totals(struct.PyTreeNode):
    """Loss and metrics of some examples, in a form any average of which is exact: `sums[name]`,
    the mean over the examples of the (weighted) values, and for weighted names
    `weights[name]`, their mean weight. However unevenly the weight is spread, an average of
    several `Totals` (over micro-batches, over devices) gives the weighted mean of all their
    examples as `sums / weights`."""

    sums: dict
    weights: dict

    @classmethod
    def of(cls, values: Mapping[str, tuple[jax.Array, jax.Array | None]]) -> "Totals":
        """The `Totals` of one batch's `weighted_values`."""
        sums = {name: jnp.mean(value) for name, (value, _) in values.items()}
        weights = {name: jnp.mean(w) for name, (_, w) in values.items() if w is not None}
        return cls(sums, weights)

    def means(self) -> dict[str, jax.Array]:
        """Each name's (weighted) mean."""
        return {
            name: total / self.weights[name] if name in self.weights else total
            for name, total in self.sums.items()
        }


def masked_sums(values: Mapping[str, tuple[jax.Array, jax.Array | None]], mask) -> dict:
    """Over the examples whose `mask` is 1 (evaluation pads its last batch): the `sums` of each
    name's (weighted) values, their `weights` (1 per example where unweighted), and the `count`
    of examples. Summed over batches and devices, `sums / weights` is each name's mean."""
    mask = jnp.asarray(mask, jnp.float32)
    sums = {name: jnp.sum(value * mask) for name, (value, _) in values.items()}
    weights = {name: jnp.sum(mask if w is None else w * mask) for name, (_, w) in values.items()}
    return {"sums": sums, "weights": weights, "count": jnp.sum(mask)}
