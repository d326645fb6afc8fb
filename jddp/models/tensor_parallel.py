"""Megatron-LM's sequence parallelism (Korthikanti et al., 2022) with its collectives written out.

Plain tensor parallelism needs nothing here: with weights split over the `tensor` axis by the
partition rules, XLA's SPMD partitioner inserts Megatron's all-reduces by itself. Sequence
parallelism replaces each of those all-reduces with a reduce-scatter along the sequence (after a
row-parallel matmul) and an all-gather (before a column-parallel one), so that LayerNorm,
dropout and the residual stream hold 1/tensor of the sequence per device. The partitioner writes
the reduce-scatter as an all-reduce plus a slice on CPU (twice the bytes, no memory saved), so
these two matmuls run under a `shard_map` that is manual over `tensor`, where `all_gather` and
`psum_scatter` are exactly the collectives that run and each is the other's transpose.

Both functions take the context mesh (the strategy sets it with `jax.set_mesh`).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

SEQUENCE = 1  # activations are (batch, sequence, features)


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

    return jax.shard_map(
        local, in_specs=(P(), P(axis, None)), out_specs=P(None, axis, None), axis_names={axis}
    )(tokens, table)


def column_parallel(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, axis: str):
    """`x @ kernel + bias` for `x` split along the sequence and `kernel` (in, out) split by
    columns: all-gather the sequence, multiply by the local columns. The result is split by
    features (whole heads, whole MLP units)."""

    def local(x, kernel, *bias):
        y = lax.all_gather(x, axis, axis=SEQUENCE, tiled=True) @ kernel
        return y + bias[0] if bias else y

    return jax.shard_map(
        local,
        in_specs=(P(None, axis, None), P(None, axis), *([P(axis)] if bias is not None else [])),
        out_specs=P(None, None, axis),
        axis_names={axis},
    )(x, kernel, *([bias] if bias is not None else []))


def row_parallel(h: jax.Array, kernel: jax.Array, axis: str) -> jax.Array:
    """`h @ kernel` for `h` split by features and `kernel` (in, out) split by rows: multiply the
    local rows, then reduce-scatter the partial sums along the sequence. Add the bias after."""

    def local(h, kernel):
        return lax.psum_scatter(h @ kernel, axis, scatter_dimension=SEQUENCE, tiled=True)

    return jax.shard_map(
        local,
        in_specs=(P(None, None, axis), P(axis, None)),
        out_specs=P(None, axis, None),
        axis_names={axis},
    )(h, kernel)
