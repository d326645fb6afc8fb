"""Megatron-LM's sequence parallelism (Korthikanti et al., 2022) with its collectives written out.

Plain tensor parallelism needs nothing here: with weights split over the `tensor` axis by the
partition rules, XLA's SPMD partitioner inserts Megatron's all-reduces by itself. Sequence
parallelism replaces each of those all-reduces with a reduce-scatter along the sequence (after a
row-parallel matmul) and an all-gather (before a column-parallel one), so that LayerNorm,
dropout and the residual stream hold 1/tensor of the sequence per device. The partitioner writes
the reduce-scatter as an all-reduce plus a slice on CPU (twice the bytes, no memory saved), so
these two matmuls run under a `shard_map` that is manual over `tensor`, where `all_gather` and
`psum_scatter` are exactly the collectives that run and each is the other's transpose.

Both functions take the context mesh (the strategy sets it with `jax.set_mesh`). Where the batch
rows are split over mesh axes the compiler partitions (`auto`'s whole-batch program), the
`shard_map`s are manual over those too, each device keeping its rows.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

SEQUENCE = 1  # activations are (batch, sequence, features)


def row_axes(axis: str) -> tuple[str, ...]:
    """The mesh axes besides `axis` that the compiler partitions here: those the batch rows are
    split over in a whole-batch program (`auto`); none inside a strategy's per-device program,
    which splits the batch by hand."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in mesh.axis_names if a != axis and a not in mesh.manual_axes)


def _manual(fn, axis: str, in_specs, out_specs):
    """`fn` as a shard_map manual over `axis` and the row axes. Specs are tuples of entries; a
    leading "rows" marks an array whose first dimension is rows, split over the row axes (whole
    where there are none)."""
    rows = row_axes(axis)

    def spec(entries):
        return P(rows or None, *entries[1:]) if entries and entries[0] == "rows" else P(*entries)

    return jax.shard_map(
        fn,
        in_specs=tuple(spec(e) for e in in_specs),
        out_specs=spec(out_specs),
        axis_names={axis, *rows},
    )


def embed_tokens(tokens: jax.Array, table: jax.Array, axis: str) -> jax.Array:
    """Rows of `table` (vocabulary, features), split by vocabulary over `axis`, for `tokens`
    (batch, sequence): each rank looks up the tokens in its part of the vocabulary (zeros for
    the rest), then the parts are summed and scattered along the sequence. The result is split
    along the sequence; no rank ever holds the whole table."""

    def local(tokens, table):
        rows = table.shape[0]
        ids = tokens - lax.axis_index(axis) * rows
        mine = (ids >= 0) & (ids < rows)
        x = jnp.take(table, jnp.where(mine, ids, 0), axis=0) * mine[..., None].astype(table.dtype)
        return lax.psum_scatter(x, axis, scatter_dimension=SEQUENCE, tiled=True)

    return _manual(local, axis, (("rows",), (axis, None)), ("rows", axis, None))(tokens, table)


def column_parallel(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, axis: str):
    """`x @ kernel + bias` for `x` split along the sequence and `kernel` (in, out) split by
    columns: all-gather the sequence, multiply by the local columns. The result is split by
    features (whole heads, whole MLP units)."""

    def local(x, kernel, *bias):
        y = lax.all_gather(x, axis, axis=SEQUENCE, tiled=True) @ kernel
        return y + bias[0] if bias else y

    in_specs = (("rows", axis, None), (None, axis), *([(axis,)] if bias is not None else []))
    return _manual(local, axis, in_specs, ("rows", None, axis))(
        x, kernel, *([bias] if bias is not None else [])
    )


def row_parallel(h: jax.Array, kernel: jax.Array, axis: str) -> jax.Array:
    """`h @ kernel` for `h` split by features and `kernel` (in, out) split by rows: multiply the
    local rows, then reduce-scatter the partial sums along the sequence. Add the bias after."""

    def local(h, kernel):
        return lax.psum_scatter(h @ kernel, axis, scatter_dimension=SEQUENCE, tiled=True)

    in_specs = (("rows", None, axis), (axis, None))
    return _manual(local, axis, in_specs, ("rows", axis, None))(h, kernel)
