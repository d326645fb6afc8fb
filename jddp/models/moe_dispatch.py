"""Expert parallelism: a mixture of experts' token-expert pairs sent to the devices that hold
their experts over the `expert` mesh axis, and their outputs sent back, by two `lax.all_to_all`s
of a fixed size (XLA:CPU has no `ragged-all-to-all` in jax 0.10.2).

Device j of an expert axis of size X holds experts j*E/X .. (j+1)*E/X - 1. Each device sends
every other one a block of `dispatch_slots` rows, enough for every pair it could ever send
there, so no pair is dropped for want of room: a token reaches an expert at most once, so at
most min(k, E/X) of its k pairs go to one device (dropless: tokens x min(k, E/X) rows); in
capacity mode no expert takes more than C pairs of the global batch, so at most E/X x C rows
go to one device (the smaller of the two bounds). `all_to_all_bytes` is what that moves.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jddp.models.moe_settings import MoESettings


def dispatch_slots(settings: MoESettings, tokens: int, global_tokens: int, expert_size: int) -> int:
    """Rows of the block one device sends each device of the expert axis (of `expert_size`
    devices) per MoE layer, for `tokens` tokens on the device and `global_tokens` in the global
    batch: the most token-expert pairs that can go from one device to another."""
    local_experts = settings.num_experts // expert_size
    slots = tokens * min(settings.experts_per_token, local_experts)
    if settings.dispatch == "capacity":
        slots = min(slots, local_experts * settings.capacity(global_tokens))
    return slots


def all_to_all_bytes(
    settings: MoESettings,
    *,
    tokens_per_device: int,
    batch_slices: int,
    embed_dim: int,
    expert_size: int,
    dtype_bytes: int = 4,
    remat: bool = False,
) -> int:
    """Bytes of the all-to-alls' results on one device per MoE layer in one training step (one
    micro-batch: times `grad_accum_steps` for a step that accumulates), as
    jddp/observe/hlo.py's `bytes_by_axes` counts them: forward, pairs out and outputs back;
    backward, their gradients the other way; with `remat` the forward's two again.

    `tokens_per_device`: the tokens of a device's share of the batch (rows x the sequence
    length it holds); `batch_slices`: how many shares the global batch's tokens are split into
    (the product of the batch axes, `expert` among them, times the context axis); `expert_size`:
    the expert axis's size; `dtype_bytes`: the activations' (4 for float32, 2 for bfloat16). 0
    without an expert axis. A tensor axis changes nothing: each tensor rank exchanges the
    same pairs."""
    if expert_size <= 1:
        return 0
    slots = dispatch_slots(
        settings, tokens_per_device, tokens_per_device * batch_slices, expert_size
    )
    passes = 6 if remat else 4
    return passes * expert_size * slots * embed_dim * dtype_bytes


def exchange(
    tokens: jax.Array,
    order: jax.Array,
    kept: jax.Array,
    group_kept: jax.Array,
    settings: MoESettings,
    axis: str,
    global_tokens: int,
    experts: Callable[[jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """Every token-expert pair's output, (tokens x k, embed) with token t's j-th pair at t*k + j
    and zeros for dropped pairs, from the experts of the devices along `axis` that hold them.

    `order`: the pairs sorted by expert, the `kept` (per expert) ones first; `group_kept`:
    (axis size, experts) the kept pairs per expert of each device of the axis (jddp/models/moe.py
    `dispatch`); `experts(rows, group_sizes)`: this device's experts on rows grouped by them."""
    size, embed = lax.axis_size(axis), tokens.shape[-1]
    local = settings.num_experts // size
    slots = dispatch_slots(settings, tokens.shape[0], global_tokens, size)
    # Sending: the kept pairs, by expert, fill each device's block from its first row.
    position = jnp.arange(order.size)
    expert = jnp.searchsorted(jnp.cumsum(kept), position, side="right")
    target = jnp.minimum(expert, settings.num_experts - 1) // local
    per_device = kept.reshape(size, local).sum(1)
    row = target * slots + position - (jnp.cumsum(per_device) - per_device)[target]
    row = jnp.where(position < kept.sum(), row, size * slots)  # dropped: sent nowhere
    pair_tokens = tokens[order // settings.experts_per_token]
    send = jnp.zeros((size * slots, embed), tokens.dtype).at[row].set(pair_tokens, mode="drop")
    received = lax.all_to_all(send, axis, 0, 0, tiled=True)  # block s: from device s
    # Receiving: each block's rows by local expert, regrouped expert by expert.
    mine = lax.dynamic_slice_in_dim(group_kept, lax.axis_index(axis) * local, local, axis=1)
    block_row = jnp.arange(slots)
    local_expert = jax.vmap(lambda c: jnp.searchsorted(jnp.cumsum(c), block_row, side="right"))(
        mine
    )  # (size, slots): `local` for the unused rows, which sort last
    by_expert = jnp.argsort(local_expert.reshape(-1), stable=True)
    outputs = experts(received[by_expert], mine.sum(0))
    returned = jnp.zeros_like(outputs).at[by_expert].set(outputs)
    back = lax.all_to_all(returned, axis, 0, 0, tiled=True)  # block s: from device s's experts
    by_pair = jnp.take(back, row, axis=0, mode="fill", fill_value=0)
    return jnp.zeros_like(by_pair).at[order].set(by_pair)
