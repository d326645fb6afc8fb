"""A global batch in one program, computing what the devices that split it compute.

The mesh strategies run the model once per device on that device's slice of the batch; `auto`
runs one program over the whole batch and lets the compiler choose how data moves. Two things
make that program compute what the per-device ones compute:
- the batch axes' names are bound (`bind`), by `jax.vmap`s of size 1, so a layer's collective
  over them (BatchNorm's `pmean` of its statistics) is the identity it is on one device: the
  statistics are the whole batch's, which the per-device strategies' `pmean`s also give;
- micro-batches take every slice's next rows at once (`micro_batches`), as gradient accumulation
  on the devices does, with row keys that draw each example's own numbers
  (jddp/core/row_keys.py).
"""

import dataclasses

import jax
import jax.numpy as jnp

from jddp.core import row_keys


@dataclasses.dataclass(frozen=True)
class Slices:
    """The batch axes' names (`axes`) and how many slices they split a batch into (`count`)."""

    axes: tuple[str, ...]
    count: int

    def bind(self, fn):
        """`fn` with the batch axes' names bound, each to an axis of one slice."""
        for name in reversed(self.axes):
            fn = _size_one_axis(fn, name)
        return fn

    def micro_batches(self, batch, steps: int, rows: int):
        """`batch` (`rows` rows first) as (steps, rows / steps, ...): micro-batch i holds rows
        i*r .. i*r + r - 1 of every slice (r = rows / count / steps), slice by slice."""

        def split(x):
            parts = x.reshape(self.count, steps, rows // self.count // steps, *x.shape[1:])
            return jnp.swapaxes(parts, 0, 1).reshape(steps, rows // steps, *x.shape[1:])

        return jax.tree.map(split, batch)

    def micro_key(self, step_key: jax.Array, index, steps: int, rows: int) -> jax.Array:
        """The row key of micro-batch `index` of `micro_batches`."""
        block = rows // self.count // steps
        return row_keys.blocked_key(
            step_key, index * block, rows // steps, block, rows // self.count
        )


def _size_one_axis(fn, name: str):
    def bound(*args):
        return jax.tree.map(
            lambda x: x[0], jax.vmap(fn, in_axes=None, axis_size=1, axis_name=name)(*args)
        )

    return bound
