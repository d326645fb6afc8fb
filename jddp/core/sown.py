"""What a Linen model reports beside its outputs in a training step, by `self.sow`: losses the
training adds to its own (a mixture of experts' load-balancing loss) and numbers each record
logs (the experts' load).

A layer sows a float32 scalar under a name: into `LOSSES` its share of the training loss
(added to the loss the gradient is taken of, not to the `loss` metric, which stays comparable
with eval), into `METRICS` a number to log. Each device sows its own, and the step averages
them over devices and micro-batches as it averages the loss: a layer sows what makes that
average right (its devices' share of a global mean, or a value already global). Several
layers' values of one name make one number: the minimum for names ending in `_min`, the
maximum for `_max`, else the mean (`combine`). Nothing is sown during initialization or
evaluation. Stacked layers (a `Pipelined` stack) sow one value per layer along a leading axis.
"""

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict
from jax import lax

LOSSES = "aux_losses"
METRICS = "aux_metrics"
COLLECTIONS = (LOSSES, METRICS)


def sown_loss(collections) -> jax.Array | None:
    """The sum of every value sown into `LOSSES` (None: nothing was)."""
    # Stacked layers (`Pipelined`) sow one value per layer, along a leading axis.
    values = [jnp.sum(v) for v in jax.tree.leaves(collections.get(LOSSES, {}))]
    return sum(values[1:], values[0]) if values else None


def sown_metrics(collections) -> dict[str, jax.Array]:
    """Each name sown into `METRICS`, its layers' values made one (min, max or mean)."""
    by_name: dict[str, list] = {}
    for path, values in flatten_dict(dict(collections.get(METRICS, {}))).items():
        by_name.setdefault(path[-1], []).extend(jax.tree.leaves(values))
    merged = {}
    for name, values in by_name.items():
        stacked = jnp.concatenate([jnp.asarray(v, jnp.float32).reshape(-1) for v in values])
        merged[name] = getattr(stacked, combine(name))()  # its min, max or mean
    return merged


def combine(name: str) -> str:
    """How several layers' values of metric `name` make one: "min", "max" or "mean"."""
    return name[-3:] if name.endswith(("_min", "_max")) else "mean"


# Per way of combining: the value before any layer's, two values made one, and the values of
# a mesh axis made one (a mean's as its sum: the caller divides). A pipeline combines its
# stages' layers with these (jddp/parallel/pipeline/ticks.py, engine.py).
_WAYS = {
    "min": (jnp.inf, jnp.minimum, lax.pmin),
    "max": (-jnp.inf, jnp.maximum, lax.pmax),
    "mean": (0.0, jnp.add, lax.psum),
}


def start(name: str) -> float:
    """Metric `name`'s value before any layer's is combined into it."""
    return _WAYS[combine(name)][0]


def fold(name: str, so_far: jax.Array, value: jax.Array) -> jax.Array:
    """`so_far` and one more layer's `value` of metric `name` made one (a mean's sum)."""
    return _WAYS[combine(name)][1](so_far, value)


def over_axis(name: str, values: jax.Array, axis: str) -> jax.Array:
    """Metric `name`'s `values` combined over mesh `axis` (a mean's summed)."""
    return _WAYS[combine(name)][2](values, axis)
