"""Random numbers that follow the example, not the device: the keys a training step gives the model.

One device draws a dropout mask for the whole global batch; eight devices each draw one for their
slice. With ordinary keys the eight slices are not the one mask cut in eight, so dropout made the
device count change the run. A *row key* is a PRNG key that also knows which rows of the global
batch the model holds (`first_row`, `rows`): a draw whose leading dimension is `rows` is taken as
one row per example, and row `r` of it draws from counters (`first_row + r`, position within the
row). Every example therefore sees the same numbers on 1 device or 8, under any strategy, mesh,
gradient accumulation or pipeline, which only move `first_row`; splits and `fold_in`s (Linen's
`make_rng`, NNX `Rngs`) keep the rows. A draw of any other shape (a noise vector shared by the
batch) is the same on every device, as on one. A key may also hold rows in blocks (`block`
consecutive rows every `stride` rows: a micro-batch taking each device's next rows at once, as
`auto` accumulates over the whole batch), and only some positions of each sequence: under context
parallelism a rank holds chunks `rank` and 2 x `size` - 1 - `rank` of 2 x `size` chunks of
`chunk` tokens (jddp/parallel/context.py), and a per-example draw whose second dimension is those
2 x `chunk` tokens draws what the whole sequence's draw holds at their true positions.

The bits are threefry2x32's, as `jax.random`'s default; only the counters differ from its own.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import random as jex_random

_THREEFRY = jex_random.threefry_prng_impl


# Key data: threefry's two words, then the rows it holds: first_row, rows, block, stride (block 0:
# consecutive rows), then the sequence chunks: chunk, rank, size (chunk 0: whole sequences).
ROWS_FIELDS = 7


def _seed(seed):
    return jnp.concatenate([_THREEFRY.seed(seed), jnp.zeros(ROWS_FIELDS, jnp.uint32)])


def _split(key, shape):
    keys = _THREEFRY.split(key[:2], shape)
    rows = jnp.broadcast_to(key[2:], (*shape, ROWS_FIELDS))
    return jnp.concatenate([keys, rows], axis=-1)


def _fold_in(key, data):
    return jnp.concatenate([_THREEFRY.fold_in(key[:2], data), key[2:]])


def _counters(shape, first_row, rows, block, stride, chunk, rank, size):
    """(row counter, position counter) of every element of a draw of `shape`."""
    if not shape:
        zero = jnp.zeros((), jnp.uint32)
        return zero, zero
    inner = math.prod(shape[1:])
    if inner >= 2**32:
        raise NotImplementedError(f"a random draw of {inner} numbers per row")
    leading = lax.broadcasted_iota(jnp.uint32, shape, 0)
    position = jnp.zeros(shape, jnp.uint32)
    for axis in range(1, len(shape)):
        step = np.uint32(math.prod(shape[axis + 1 :]))
        index = lax.broadcasted_iota(jnp.uint32, shape, axis)
        if axis == 1:
            split = chunk * 2 == shape[1]
            index = jnp.where(split, _true_position(index, chunk, rank, size), index)
        position = position + index * step
    blocks = jnp.maximum(block, np.uint32(1))
    in_blocks = leading // blocks * stride + leading % blocks
    row = first_row + jnp.where(block == 0, leading, in_blocks)
    per_example = rows == np.uint32(shape[0])
    return jnp.where(per_example, row, leading), position


def _true_position(index, chunk, rank, size):
    """Token `index` of a context rank's two chunks at its position in the whole sequence."""
    chunk = jnp.maximum(chunk, np.uint32(1))
    back = (2 * size - 1 - rank) * chunk + index - chunk
    return jnp.where(index < chunk, rank * chunk + index, back)


def _random_bits(key, bit_width, shape):
    row, position = _counters(tuple(shape), *key[2:])
    bits1, bits2 = jex_random.threefry2x32_p.bind(key[0], key[1], row, position)
    dtype = np.dtype(f"uint{bit_width}")
    if bit_width == 64:
        high = lax.convert_element_type(bits1, dtype)
        return lax.shift_left(high, np.uint64(32)) | lax.convert_element_type(bits2, dtype)
    return lax.convert_element_type(bits1 ^ bits2, dtype)


ROW_KEYS = jex_random.define_prng_impl(
    key_shape=(2 + ROWS_FIELDS,),
    seed=_seed,
    split=_split,
    random_bits=_random_bits,
    fold_in=_fold_in,
    name="jddp_rows",
    tag="jr",
)


def batch_key(key: jax.Array, first_row, rows: int) -> jax.Array:
    """A row key for a model call that holds rows `first_row .. first_row + rows - 1` of the
    global batch, drawing as `key` (a default-implementation key: the step's) would for the whole
    batch."""
    return blocked_key(key, first_row, rows, 0, 0)


def blocked_key(key: jax.Array, first_row, rows: int, block: int, stride: int) -> jax.Array:
    """A row key for `rows` rows of the global batch taken `block` at a time every `stride` rows
    from `first_row` (row k of the call is global row first_row + k // block * stride +
    k % block), drawing as `key` (the step's) would for the whole batch."""
    data = jax.random.key_data(key).astype(jnp.uint32)
    rows_part = [jnp.asarray(first_row, jnp.uint32), *map(jnp.uint32, (rows, block, stride))]
    rows_part += [jnp.zeros((), jnp.uint32)] * 3  # whole sequences
    return jax.random.wrap_key_data(jnp.concatenate([data, jnp.stack(rows_part)]), impl=ROW_KEYS)


def sub_batch_key(key: jax.Array, start, rows: int) -> jax.Array:
    """`key` (a row key of consecutive rows) for rows `start .. start + rows - 1` of the rows it
    holds: a micro-batch's or a pipeline stage's part of a device's batch."""
    data = jax.random.key_data(key)
    first = data[2] + jnp.asarray(start, jnp.uint32)
    rows_part = jnp.stack([first, jnp.uint32(rows), *data[4:]])
    return jax.random.wrap_key_data(jnp.concatenate([data[:2], rows_part]), impl=ROW_KEYS)


def sequence_chunks_key(key: jax.Array, chunk: int, rank, size: int) -> jax.Array:
    """`key` (a row key) for a call that holds, of each sequence, chunks `rank` and
    2 x `size` - 1 - `rank` of `chunk` tokens (context parallelism's balanced layout)."""
    data = jax.random.key_data(key)
    chunks = jnp.stack([jnp.uint32(chunk), jnp.asarray(rank, jnp.uint32), jnp.uint32(size)])
    return jax.random.wrap_key_data(jnp.concatenate([data[:6], chunks]), impl=ROW_KEYS)


def as_row_key(key: jax.Array, rows: int) -> jax.Array:
    """`key` if it is a row key, else a row key for a whole batch of `rows` drawn from it."""
    if jax.random.key_impl(key) == ROW_KEYS:
        return key
    return batch_key(key, 0, rows)
