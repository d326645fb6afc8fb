"""A global batch seen as the slices devices would hold, inside one program.

The mesh strategies run the model once per device on that device's slice of the batch; `auto`
runs one program over the whole batch and lets the compiler choose how data moves. To compute
exactly what the per-device strategies compute, it runs the model once per slice too: under
nested `jax.vmap`s named as the mesh's batch axes, so a layer's collective over them (BatchNorm's
`pmean` of its statistics) and each example's random draws (jddp/core/row_keys.py) are the same,
while parameters enter unbatched and their gradient is one sum the compiler may partition as it
likes. A grid is `((axis name, size), ...)`: the batch axes in mesh order.
"""

import math

import jax
import jax.numpy as jnp

from jddp.core import row_keys
from jddp.errors import ShapeError

Grid = tuple[tuple[str, int], ...]


def split_batch(batch, grid: Grid, rows: int):
    """`batch` (rows first) as (*grid sizes, rows per slice, ...): slice d holds rows
    d*R .. d*R + R - 1, as device d of the batch axes would."""
    sizes = tuple(size for _, size in grid)
    slices = math.prod(sizes)
    if rows % slices:
        raise ShapeError(
            f"a batch of {rows} examples does not split over {slices} devices; "
            f"use a multiple of {slices}"
        )
    return jax.tree.map(lambda x: x.reshape(*sizes, rows // slices, *x.shape[1:]), batch)


def slice_keys(step_key: jax.Array, grid: Grid, rows_per_slice: int) -> jax.Array:
    """Row keys of every slice (shaped as the grid): slice d's rows start at d * rows_per_slice."""
    sizes = tuple(size for _, size in grid)
    first_rows = jnp.arange(math.prod(sizes), dtype=jnp.uint32).reshape(sizes) * rows_per_slice
    key = lambda first: row_keys.batch_key(step_key, first, rows_per_slice)  # noqa: E731
    return over_grid(key, len(sizes))(first_rows)


def over_grid(fn, dims: int, in_axes=0, grid: Grid = ()):
    """`fn` mapped over `dims` leading dimensions; with `grid`, the maps carry its axis names
    (collectives over them reduce across slices) and shard those dimensions over the mesh axes
    of the same names."""
    for dim in reversed(range(dims)):
        name = grid[dim][0] if grid else None
        fn = jax.vmap(fn, in_axes=in_axes, axis_name=name, spmd_axis_name=name)
    return fn


def mean_over_grid(tree, dims: int):
    """Each leaf's mean over its `dims` leading dimensions (floats), or its first entry (others:
    step counters, the same in every slice)."""

    def mean(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return x.mean(axis=tuple(range(dims)))
        return x[(0,) * dims]

    return jax.tree.map(mean, tree)
