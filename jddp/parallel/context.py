"""Context parallelism: every sequence split along its length over the mesh's `context` axis, and
causal attention computed exactly over the whole sequence all the same.

The layout balances the causal work. A sequence of L tokens is cut into 2C chunks of n = L / 2C;
context rank c holds chunks c and 2C - 1 - c (one from the front, one from the back), so every
rank's queries see as many keys as every other's (Megatron-LM's and MaxText's load-balanced
layout). `split_sequence` cuts a rank's part out of a batch entry, `positions` gives its tokens'
true positions (for learned and rotary position embeddings).

Attention (`attention`) takes the rank's queries, keys and values and the axis:

    ring        the key/value blocks travel around the ring of context ranks (`ppermute`), one
                hop per step, while each rank folds the block it holds into its queries' online
                softmax (Liu et al., 2023). Holds one remote block at a time. The backward pass
                is written out (flash attention's): it recomputes each block's probabilities from
                the saved log-sum-exp and sends the block's key/value gradients around with it,
                so no rank ever keeps the whole sequence's keys. C - 1 hops forward, C backward.
    all_gather  every rank gathers all keys and values once (MaxText's default for short rings):
                fewer, larger messages, the whole sequence's keys and values per rank.

With the balanced layout, the ring skips every block the causal mask hides entirely: at hop t the
block from rank r = c - t (mod C) is seen whole by all of c's queries when r < c (its front
chunk only) or by c's back chunk alone when r > c, half a diagonal block's work either way.

A sliding window (`window` > 0: a query at position i sees keys i - window + 1 .. i, as in
transformers' Mistral) masks every block by the true positions of its queries and keys, so both
implementations attend exactly as a window over the whole sequence does. The ring also skips the
blocks the window hides entirely: those of ranks r with (|c - r| - 1) n + 1 >= window (the
nearest of their keys is that far behind c's nearest query), so a rank computes about
window / n blocks, not C.

Packed documents (`segment_ids`: rows of documents laid end to end, one id per document) join
every mask with segment equality: a query sees a key of its own document only. The ids are split
over the context axis as the tokens are (`split_batch` cuts every entry of the sequence's
length), travel the ring beside their keys (all_gather: are gathered with them), and the masks
stay causal by the row's true positions, within which a document's tokens are contiguous.

Everything here runs inside a `shard_map` that is manual over the context axis (jddp's mesh
strategies run their per-device program so); the functions read the rank from `lax.axis_index`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jddp.core import row_keys
from jddp.errors import ConfigError, ShapeError

AXIS = "context"
IMPLEMENTATIONS = ("ring", "all_gather")
SEQUENCE = 1  # activations and batch entries are (rows, sequence, ...)
_MASKED = -1e30  # a finite minus infinity: a row that sees nothing yet must not give NaN


def check_implementation(name: str) -> None:
    if name not in IMPLEMENTATIONS:
        raise ConfigError(
            f"unknown parallel.context_attention {name!r}; choose 'ring' (one key/value block "
            "at a time) or 'all_gather' (every key and value at once, for short rings)"
        )


def check_length(length: int, context: int) -> None:
    """A ShapeError unless sequences of `length` tokens cut into 2 x `context` equal chunks."""
    if length % (2 * context):
        below = length // (2 * context) * 2 * context
        hint = " or ".join(str(n) for n in (below, below + 2 * context) if n > 0)
        raise ShapeError(
            f"context parallelism cuts each sequence into 2 x context = {2 * context} equal "
            f"chunks, and {length} tokens do not divide; use a data.seq_len that is a multiple "
            f"of {2 * context}, e.g. {hint}, or a smaller context size in parallel.mesh"
        )


def _rank_and_size(axis: str):
    return lax.axis_index(axis), lax.axis_size(axis)


def chunk_positions(rank, size: int, chunk: int) -> jax.Array:
    """The true positions of the 2 x `chunk` tokens context rank `rank` of `size` holds."""
    steps = jnp.arange(chunk)
    return jnp.concatenate([rank * chunk + steps, (2 * size - 1 - rank) * chunk + steps])


def positions(local_length: int, axis: str = AXIS) -> jax.Array:
    """The true positions of this rank's `local_length` tokens (its front and back chunks)."""
    rank, size = _rank_and_size(axis)
    return chunk_positions(rank, size, local_length // 2)


def split_sequence(x: jax.Array, axis: str = AXIS) -> jax.Array:
    """This rank's two chunks of `x` (rows, L, ...) along the sequence: (rows, 2L / 2C, ...)."""
    rank, size = _rank_and_size(axis)
    check_length(x.shape[SEQUENCE], size)
    chunk = x.shape[SEQUENCE] // (2 * size)
    front = lax.dynamic_slice_in_dim(x, rank * chunk, chunk, SEQUENCE)
    back = lax.dynamic_slice_in_dim(x, (2 * size - 1 - rank) * chunk, chunk, SEQUENCE)
    return jnp.concatenate([front, back], axis=SEQUENCE)


def whole_sequence(x: jax.Array, axis: str = AXIS) -> jax.Array:
    """`split_sequence`'s inverse: the whole sequences (rows, L, ...) from every rank's two
    chunks (`x`: this rank's, (rows, 2L / 2C, ...)), by one all-gather."""
    size = lax.axis_size(axis)
    chunk = x.shape[SEQUENCE] // 2
    gathered = lax.all_gather(x, axis, axis=SEQUENCE, tiled=True)  # rank by rank
    steps = np.arange(chunk)
    held = np.concatenate(  # the true positions of each rank's front and back chunks
        [(rank * chunk + steps, (2 * size - 1 - rank) * chunk + steps) for rank in range(size)]
    ).ravel()
    return jnp.take(gathered, np.argsort(held), axis=SEQUENCE)


def split_batch(batch, length: int, axis: str = AXIS):
    """Every entry of `batch` whose second dimension is the sequence (`length`) cut to this
    rank's chunks; per-example entries (labels, weights, masks of shape (rows,)) stay whole."""

    def split(x):
        return split_sequence(x, axis) if x.ndim >= 2 and x.shape[SEQUENCE] == length else x

    return jax.tree.map(split, batch)


def chunks_key(rng: jax.Array, tokens: jax.Array, axis: str = AXIS) -> jax.Array:
    """`rng` (a row key for `tokens`' rows, whole sequences) for this rank's chunks: a
    per-example draw over them takes the whole sequence's numbers at their true positions, so
    dropout does not depend on the context size (jddp/core/row_keys.py)."""
    rank, size = _rank_and_size(axis)
    check_length(tokens.shape[SEQUENCE], size)
    return row_keys.sequence_chunks_key(rng, tokens.shape[SEQUENCE] // (2 * size), rank, size)


def check_model(model, axis: str = AXIS) -> None:
    """A ConfigError unless `model` computes its attention over the context axis (it declares
    `context_axis` and was given this one)."""
    name = type(model).__name__
    declared = getattr(model, "context_axis", "absent")
    if declared == "absent":
        raise ConfigError(
            f"parallel.mesh has a context axis but the model {name} has no context-parallel "
            "attention (no context_axis field); use gpt or llama, give your model a "
            "context_axis field and call jddp.parallel.context.attention in its attention "
            "(docs/context-parallel.md), or remove the context axis"
        )
    if declared != axis:
        raise ConfigError(
            f"parallel.mesh has a context axis but the model {name} was built with "
            f"context_axis={declared!r}; build it with context_axis={axis!r} (jddp's configs "
            "do), or remove the context axis"
        )


# --------------------------------------------------------------------------------- attention
def attention(
    q,
    k,
    v,
    axis: str = AXIS,
    implementation: str = "ring",
    window: int = 0,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal softmax attention over the whole sequence for this rank's queries (within a
    sliding `window` of keys when > 0; within its own document when `segment_ids` (rows, 2n),
    this rank's part of the rows' document ids, are given: a query sees a key only where their
    ids are equal).

    q (rows, 2n, heads, head_dim); k, v (rows, 2n, kv_heads, head_dim): this rank's tokens in the
    balanced layout (`split_sequence`), positions already applied (rotary). Query head h reads
    key/value head h // (heads / kv_heads). Returns (rows, 2n, heads, head_dim) in q's dtype;
    computed in float32. A building block for an own model's attention; jddp's GPT and Llama
    call it when the mesh has a context axis."""
    check_implementation(implementation)
    if q.shape[SEQUENCE] % 2:
        raise ShapeError(
            f"context attention takes a rank's two equal chunks, got {q.shape[SEQUENCE]} tokens"
        )
    if q.shape[2] % k.shape[2]:
        raise ShapeError(f"{q.shape[2]} query heads do not group over {k.shape[2]} key/value heads")
    groups = q.shape[2] // k.shape[2]
    qg = _grouped(q.astype(jnp.float32), groups)
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    if implementation == "all_gather":
        out = _all_gather_attention(qg, k, v, axis, window, segment_ids)
    else:
        out = _ring(qg, k, v, segment_ids, axis, window)
    return _ungrouped(out).astype(q.dtype)


def _grouped(q, groups):
    """(rows, seq, heads, d) -> (rows, kv_heads, groups, seq, d)."""
    rows, seq, heads, dim = q.shape
    return q.reshape(rows, seq, heads // groups, groups, dim).transpose(0, 2, 3, 1, 4)


def _ungrouped(o):
    rows, kv_heads, groups, seq, dim = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(rows, seq, kv_heads * groups, dim)


def _scores(q, k):
    return jnp.einsum("bhgqd,bkhd->bhgqk", q, k) / math.sqrt(q.shape[-1])


def visible(query_positions, key_positions, window: int = 0) -> jax.Array:
    """(queries, keys) booleans: which key each query sees, causally and, when `window` > 0,
    within its last `window` positions (itself included)."""
    behind = query_positions[:, None] - key_positions[None, :]
    seen = behind >= 0
    return seen & (behind < window) if window else seen


def same_document(query_segments, key_segments) -> jax.Array:
    """(rows, 1, 1, queries, keys) booleans, broadcasting over grouped scores: which key is in
    its query's document (equal segment ids)."""
    return (query_segments[:, :, None] == key_segments[:, None, :])[:, None, None]


def _joined(seen, query_segments, key_segments):
    """The mask `seen` (or None: all) joined with the documents' (None: no segment ids)."""
    if query_segments is None:
        return seen
    same = same_document(query_segments, key_segments)
    return same if seen is None else seen & same


def _all_gather_attention(q, k, v, axis, window, segments):
    rank, size = _rank_and_size(axis)
    chunk = q.shape[3] // 2
    keys = lax.all_gather(k, axis, axis=SEQUENCE, tiled=True)
    values = lax.all_gather(v, axis, axis=SEQUENCE, tiled=True)
    key_positions = jnp.concatenate([chunk_positions(r, size, chunk) for r in range(size)])
    seen = visible(chunk_positions(rank, size, chunk), key_positions, window)
    if segments is not None:
        key_segments = lax.all_gather(segments, axis, axis=SEQUENCE, tiled=True)
        seen = _joined(seen, segments, key_segments)
    s = jnp.where(seen, _scores(q, keys), _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgqk,bkhd->bhgqd", p, values)


# The ring. State per query row: output (unnormalized), running max, running sum of exp.
def _fold(state, q, k, v, seen=None):
    """The online-softmax state after folding in the block (k, v); `seen`: its causal mask."""
    out, top, total = state
    s = _scores(q, k)
    if seen is not None:
        s = jnp.where(seen, s, _MASKED)
    new_top = jnp.maximum(top, s.max(-1))
    p = jnp.exp(s - new_top[..., None])
    if seen is not None:
        p = jnp.where(seen, p, 0.0)
    correction = jnp.exp(top - new_top)
    out = out * correction[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p, v)
    return out, new_top, total * correction + p.sum(-1)


def _rows(state, lo, hi):
    return tuple(x[:, :, :, lo:hi] for x in state)


def _set_rows(state, part, lo):
    pairs = zip(state, part, strict=True)
    return tuple(lax.dynamic_update_slice_in_dim(x, y, lo, 3) for x, y in pairs)


def _diagonal_mask(rank, size, chunk, window):
    mine = chunk_positions(rank, size, chunk)
    return visible(mine, mine, window)


def _hop_branch(rank, source, chunk, window):
    """Which of a hop's branches folds the block from rank `source`: 0 earlier (source <
    rank), 1 later, 2 none (with a window: it hides the whole block)."""
    branch = jnp.where(source < rank, 0, 1)
    if not window:
        return branch
    return jnp.where((jnp.abs(source - rank) - 1) * chunk + 1 >= window, 2, branch)


def _hop_masks(rank, source, size, chunk, window):
    """(earlier, later): the window's masks of the block from rank `source`: all this rank's
    queries over its front chunk, this rank's back chunk over both of its chunks; (None,
    None) without a window (causality alone hides nothing there)."""
    if not window:
        return None, None
    mine, theirs = chunk_positions(rank, size, chunk), chunk_positions(source, size, chunk)
    return visible(mine, theirs[:chunk], window), visible(mine[chunk:], theirs, window)


def _hop(axis, size, tree):
    """`tree` passed one rank along the ring: rank c receives rank c - 1's."""
    if _inside_stage_conditionals():
        # XLA:CPU's collective-permute waits for every device of the program, so one that only
        # a pipeline stage's devices run (in a branch of the schedule's conditionals) never
        # completes; an all-gather waits only for its group: gather, keep the neighbour's.
        source = (lax.axis_index(axis) - 1) % size
        return jax.tree.map(lambda x: lax.all_gather(x, axis)[source], tree)
    return lax.ppermute(tree, axis, [(i, (i + 1) % size) for i in range(size)])


def _inside_stage_conditionals() -> bool:
    """Whether this runs in a pipeline's per-device program on CPU (see `_hop`)."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return jax.default_backend() == "cpu" and "stage" in manual


def _front_segments(segments, chunk):
    return None if segments is None else segments[:, :chunk]


def _back_segments(segments, chunk):
    return None if segments is None else segments[:, chunk:]


def _ring_forward(q, k, v, segments, axis, window):
    rank, size = _rank_and_size(axis)
    chunk, dim = q.shape[3] // 2, k.shape[-1]
    zeros = jnp.zeros(q.shape[:-1], jnp.float32)
    state = (jnp.zeros_like(q), jnp.full_like(zeros, _MASKED), zeros)
    diagonal = _joined(_diagonal_mask(rank, size, chunk, window), segments, segments)
    state = _fold(state, q, k, v, diagonal)
    # One message a hop: keys and values, and their document ids beside them.
    block = (jnp.concatenate([k, v], axis=-1), segments)
    for hop in range(1, size):
        block = _hop(axis, size, block)
        source = (rank - hop) % size
        seen_earlier, seen_later = _hop_masks(rank, source, size, chunk, window)

        def earlier(state, block, seen=seen_earlier):  # every query sees the front chunk
            front, theirs = block[0][:, :chunk], _front_segments(block[1], chunk)
            seen = _joined(seen, segments, theirs)
            return _fold(state, q, front[..., :dim], front[..., dim:], seen)

        def later(state, block, seen=seen_later):  # only the back chunk's queries see it at all
            keys, seen = block[0], _joined(seen, _back_segments(segments, chunk), block[1])
            back = _rows(state, chunk, 2 * chunk)
            back = _fold(back, q[:, :, :, chunk:], keys[..., :dim], keys[..., dim:], seen)
            return _set_rows(state, back, chunk)

        branches = [earlier, later] + [lambda state, block: state] * bool(window)
        state = lax.switch(_hop_branch(rank, source, chunk, window), branches, state, block)
    out, top, total = state
    return out / total[..., None], top + jnp.log(total)


def _block_grads(q, k, v, do, lse, delta, seen=None):
    """(dq, dk, dv) of one block, its probabilities recomputed from the log-sum-exp."""
    p = jnp.exp(_scores(q, k) - lse[..., None])
    if seen is not None:
        p = jnp.where(seen, p, 0.0)
    dv = jnp.einsum("bhgqk,bhgqd->bkhd", p, do)
    ds = p * (jnp.einsum("bhgqd,bkhd->bhgqk", do, v) - delta[..., None]) / math.sqrt(q.shape[-1])
    return jnp.einsum("bhgqk,bkhd->bhgqd", ds, k), jnp.einsum("bhgqk,bhgqd->bkhd", ds, q), dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, segments, axis, window):
    return _ring_forward(q, k, v, segments, axis, window)[0]


def _ring_fwd(q, k, v, segments, axis, window):
    out, lse = _ring_forward(q, k, v, segments, axis, window)
    return out, (q, k, v, segments, out, lse)


def _ring_bwd(axis, window, residuals, do):
    q, k, v, segments, out, lse = residuals
    rank, size = _rank_and_size(axis)
    chunk, dim = q.shape[3] // 2, k.shape[-1]
    delta = jnp.sum(do * out, axis=-1)
    diagonal = _joined(_diagonal_mask(rank, size, chunk, window), segments, segments)
    dq, dk, dv = _block_grads(q, k, v, do, lse, delta, diagonal)
    # The block's key/value gradients travel with it (one message: keys, values and their
    # gradients, which also keeps XLA from reusing the forward's hops of the same keys and
    # values, and so from keeping the whole sequence's alive until the backward) and arrive
    # home after the last hop.
    block = (jnp.concatenate([k, v, dk, dv], axis=-1), segments)
    for hop in range(1, size):
        block = _hop(axis, size, block)
        source = (rank - hop) % size
        seen_earlier, seen_later = _hop_masks(rank, source, size, chunk, window)

        def earlier(dq, block, seen=seen_earlier):
            front, theirs = block[0][:, :chunk], _front_segments(block[1], chunk)
            k, v = front[..., :dim], front[..., dim : 2 * dim]
            seen = _joined(seen, segments, theirs)
            g_q, g_k, g_v = _block_grads(q, k, v, do, lse, delta, seen)
            gradients = jnp.concatenate([g_k, g_v], axis=-1)
            return dq + g_q, (block[0].at[:, :chunk, ..., 2 * dim :].add(gradients), block[1])

        def later(dq, block, seen=seen_later):
            k, v = block[0][..., :dim], block[0][..., dim : 2 * dim]
            back = slice(chunk, 2 * chunk)
            seen = _joined(seen, _back_segments(segments, chunk), block[1])
            g_q, g_k, g_v = _block_grads(
                q[:, :, :, back], k, v, do[:, :, :, back], lse[..., back], delta[..., back], seen
            )
            gradients = jnp.concatenate([g_k, g_v], axis=-1)
            return dq.at[:, :, :, back].add(g_q), (
                block[0].at[..., 2 * dim :].add(gradients),
                block[1],
            )

        branches = [earlier, later] + [lambda dq, block: (dq, block)] * bool(window)
        dq, block = lax.switch(_hop_branch(rank, source, chunk, window), branches, dq, block)
    home = block[0][..., 2 * dim :]
    if size > 1:
        home = _hop(axis, size, home)
    return dq, home[..., :dim], home[..., dim:], None


_ring.defvjp(_ring_fwd, _ring_bwd)
