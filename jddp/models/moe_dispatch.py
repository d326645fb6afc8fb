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

    `tokens_per_device`: the tokens of a device's slice of the batch (rows x sequence length);
    `batch_slices`: how many slices the global batch is split into (the product of the batch
    axes, `expert` among them); `expert_size`: the expert axis's size; `dtype_bytes`: the
    activations' (4 for float32, 2 for bfloat16). 0 without an expert axis."""
    if expert_size <= 1:
        return 0
    slots = dispatch_slots(
        settings, tokens_per_device, tokens_per_device * batch_slices, expert_size
    )
    passes = 6 if remat else 4
    return passes * expert_size * slots * embed_dim * dtype_bytes
