"""A mixture-of-experts MLP for jddp's decoders (GPT, Llama), set by `model_args.moe`
(jddp/models/moe_settings.py): a router picks each token's experts, the token goes through
them, and their outputs are summed with the router's weights.

Every number that depends on more than one token is the global batch's, on any layout: the
experts' load, the load-balancing loss's token fractions and, in capacity mode, which tokens
are dropped. A device's counts come from the others over the batch axes (`axis_name`, bound
as BatchNorm's is: jddp/core/slices.py, jddp/core/modules.py) and a context axis; where no
batch axis is bound, the program holds the whole batch and the counts are its own.

- Router: `router/kernel` (embed, experts), logits in float32.
- Experts, stacked on a leading expert dimension, which an `expert` mesh axis splits (the
  pairs then go to their experts' devices and back by all-to-all: jddp/models/moe_dispatch.py):
  `experts/up` (experts, embed, width), `experts/down` (experts, width, embed), and for gated
  (SwiGLU) models `experts/gate` (experts, embed, width); no biases. GPT's experts apply
  GELU (tanh), Llama's SwiGLU; on a tensor axis each is split as Megatron splits an MLP.
- Dropless dispatch: the token-expert pairs sorted by expert, then three (two) grouped matmuls
  (`jax.lax.ragged_dot`), then each token's outputs summed with its weights. Capacity
  dispatch: the same, less the pairs past their expert's capacity in global token order (row
  by row of the global batch, each row's tokens in order), which add nothing.
- Shared expert (`shared_expert_dim` > 0): the model's dense MLP, `shared_expert/...`, on
  every token, times sigmoid(`shared_expert_gate/kernel` . x) where gated.
- Sown (jddp/core/sown.py): `moe_load_balance_loss` = E sum_e f_e P_e, with f_e the fraction
  of the global batch's tokens routed to expert e (before any drop; they sum to k, so even
  routing gives k, as in Mixtral's Hugging Face code) and P_e its mean router probability;
  `moe_z_loss` = the mean over tokens of logsumexp(logits)^2 (ST-MoE); `moe_expert_load_min`
  / `_max` (f_e's least and greatest); `moe_dropped_fraction` (capacity: the dropped share of
  token-expert pairs). Their weighted sum over the layers' mean is the loss added.

Hugging Face tensors the names are chosen for (per layer i, expert e; kernels transposed):
Mixtral `block_sparse_moe.gate` -> `block_i/mlp/router/kernel`, `experts.e.w1 / w3 / w2` ->
`experts/gate / up / down[e]`; Qwen2-MoE and Qwen3-MoE `mlp.gate` -> `router/kernel`,
`mlp.experts.e.{gate,up,down}_proj` -> `experts/{gate,up,down}[e]`,
`mlp.shared_expert.{gate,up,down}_proj` -> `shared_expert/{gate,up,proj}`,
`mlp.shared_expert_gate` -> `shared_expert_gate/kernel`.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jddp.core import sown
from jddp.errors import ConfigError
from jddp.models import moe_dispatch
from jddp.models.moe_settings import MoESettings
from jddp.parallel import context

INIT_STD = 0.02  # the decoders' initializer (jddp/models/decoder.py)


def route(logits: jax.Array, settings: MoESettings) -> tuple[jax.Array, jax.Array]:
    """(weights, experts), each (tokens, k): every token's experts and the weights its outputs
    are summed with, from float32 router `logits` (tokens, experts)."""
    k = settings.experts_per_token
    if settings.router_order == "topk_softmax":
        top, experts = lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts
    weights, experts = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if settings.normalize_top_k:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


def bound_axes(axis_name) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Of `axis_name` (a name, a tuple of them, or None), (the axes bound where this runs that
    split the batch, those bound with one slice each: `auto`'s, jddp/core/slices.py). Outside
    a strategy's step none is bound, and the program holds the whole batch."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name or ())
    try:
        sizes = [lax.axis_size(name) for name in names]
    except NameError:  # outside a strategy's step (a plain apply)
        return (), ()
    split = tuple(name for name, size in zip(names, sizes, strict=True) if size > 1)
    return split, tuple(name for name in names if name not in split)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, masked: bool):
    """Row r of `x` (rows, in) times `w[e]` (experts, in, out), e the group of the row:
    `group_sizes` consecutive rows per expert, rows past their sum giving zeros. `masked`: as
    one masked product with every expert's weights (E times the FLOPs, as jax 0.10.2 lowers
    `ragged_dot` off TPU anyway), for programs under `vmap` (`auto`'s batch axes,
    jddp/core/slices.py), where jax 0.10.2's `ragged_dot` raises NotImplementedError."""
    if not masked:
        return lax.ragged_dot(x, w, group_sizes)
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(x.shape[0])
    member = (row >= (ends - group_sizes)[:, None]) & (row < ends[:, None])  # (experts, rows)
    return jnp.einsum("er,ri,eio->ro", member.astype(x.dtype), x, w)


def device_index(axes: tuple[str, ...]) -> jax.Array:
    """This device's place in the global batch's order of the devices over the batch `axes`
    (row blocks in the axes' order)."""
    index = 0
    for name in axes:
        index = index * lax.axis_size(name) + lax.axis_index(name)
    return index


def every_device(counts: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Every device's `counts` over the batch `axes`, (devices, ...) in the global batch's
    order. Integer counts only: nothing here is differentiated."""
    devices = math.prod(lax.axis_size(name) for name in axes)
    # An all-gather as a psum of one-hot rows, over any number of axes at once.
    rows = jnp.zeros((devices, *counts.shape), counts.dtype).at[device_index(axes)].set(counts)
    return lax.psum(rows, axes)


class Pairs(NamedTuple):
    """A device's token-expert pairs, arranged for the experts."""

    order: jax.Array  # the pairs (token t's j-th at t*k + j) by expert, kept ones first
    kept: jax.Array  # kept pairs per expert: the group sizes of `order`'s head
    total: jax.Array  # the global batch's pairs per expert, kept or not
    total_kept: jax.Array  # the global batch's kept pairs per expert
    global_tokens: int
    # Under expert parallelism, (expert axis size, experts): the kept pairs per expert of each
    # device of this one's expert group (the devices it exchanges pairs with), in axis order.
    group_kept: jax.Array | None = None


def dispatch(
    experts: jax.Array,
    settings: MoESettings,
    axes: tuple[str, ...],
    expert_axis: str | None = None,
    context_axis: str | None = None,
) -> Pairs:
    """The pairs of each token (`experts`: (rows, sequence, k), each token's experts) and its
    experts, sorted by expert; in capacity mode without those past their expert's capacity in
    the global batch's order. `axes`: the batch axes bound here (`bound_axes`); `expert_axis`:
    the one of them the experts are split over, if any; `context_axis`: the axis this device's
    rows' sequences are split over, if any (jddp/parallel/context.py)."""
    num_experts = settings.num_experts
    own = experts.reshape(-1)
    if context_axis:  # the global order is the whole sequences': each rank sees its rows' whole
        experts = context.whole_sequence(experts, context_axis)
    pair_expert = experts.reshape(-1)
    counts = jnp.bincount(pair_expert, length=num_experts)
    every = every_device(counts, axes) if axes else counts[None]  # (devices, experts)
    index = device_index(axes) if axes else 0
    earlier = jnp.cumsum(every, 0) - every  # each expert's pairs from the devices before each
    global_tokens = math.prod(experts.shape[:2]) * every.shape[0]
    keep, kept_every = None, every
    if settings.dispatch == "capacity":
        capacity = settings.capacity(global_tokens)
        kept_every = jnp.clip(capacity - earlier, 0, every)
        order = jnp.argsort(pair_expert, stable=True)  # by expert, each in token order
        by_expert = pair_expert[order]
        starts = jnp.cumsum(counts) - counts
        rank = earlier[index][by_expert] + jnp.arange(order.size) - starts[by_expert]
        keep = jnp.zeros(order.shape, bool).at[order].set(rank < capacity)  # by global place
    total, total_kept = every.sum(0), kept_every.sum(0)
    if context_axis:  # this rank's own pairs, and every device's kept ones, context ranks apart
        if keep is not None:
            keep = context.split_sequence(keep.reshape(experts.shape), context_axis).reshape(-1)
        pair_expert, axes = own, (*axes, context_axis)
        weights = None if keep is None else keep.astype(counts.dtype)
        kept_here = jnp.bincount(pair_expert, weights, length=num_experts).astype(counts.dtype)
        kept_every, index = every_device(kept_here, axes), device_index(axes)
    # By expert, the kept pairs first: the dropped ones fall past every group.
    key = pair_expert if keep is None else jnp.where(keep, pair_expert, num_experts)
    order = jnp.argsort(key, stable=True)
    group_kept = None
    if expert_axis:
        stride = math.prod(lax.axis_size(a) for a in axes[axes.index(expert_axis) + 1 :])
        group = jnp.arange(lax.axis_size(expert_axis)) - lax.axis_index(expert_axis)
        group_kept = kept_every[index + group * stride]
    return Pairs(order, kept_every[index], total, total_kept, global_tokens, group_kept)


def expert_mlps(rows, group_sizes, up, down, gate=None, masked: bool = False):
    """The experts' MLPs (weights stacked by expert: `up`, `gate` (experts, in, width), `down`
    (experts, width, in)) on `rows` grouped by expert (`group_sizes`); GELU, or SwiGLU with a
    `gate`."""
    h = grouped_matmul(rows, up, group_sizes, masked)
    if gate is not None:
        h = jax.nn.silu(grouped_matmul(rows, gate, group_sizes, masked)) * h
    else:
        h = nn.gelu(h, approximate=True)
    return grouped_matmul(h, down, group_sizes, masked)


class Experts(nn.Module):
    """`num_experts` MLPs of `width`, weights stacked on a leading expert dimension, applied to
    rows grouped by expert (`group_sizes`; rows past their sum give zeros). With `tensor_axis`
    in the mesh, each MLP is split over it as Megatron splits one: `up` and `gate` by columns,
    `down` by rows, the partial outputs summed across the axis."""

    num_experts: int
    width: int
    gated: bool
    residual_init_std: float
    masked: bool = False  # `grouped_matmul`'s masked form (under vmap)
    tensor_axis: str | None = None

    @nn.compact
    def __call__(self, rows, group_sizes):
        shape = (self.num_experts, rows.shape[-1], self.width)
        down_shape = (self.num_experts, self.width, rows.shape[-1])
        normal = nn.initializers.normal
        weights = {
            "up": self.param("up", normal(INIT_STD), shape).astype(rows.dtype),
            "down": self.param("down", normal(self.residual_init_std), down_shape),
        }
        weights["down"] = weights["down"].astype(rows.dtype)
        if self.gated:
            weights["gate"] = self.param("gate", normal(INIT_STD), shape).astype(rows.dtype)
        apply = functools.partial(expert_mlps, masked=self.masked)
        if self.tensor_axis is None or self.is_initializing():
            return apply(rows, group_sizes, **weights)
        axis = self.tensor_axis
        columns, by_rows = P(None, None, axis), P(None, axis, None)
        specs = {name: by_rows if name == "down" else columns for name in weights}
        return jax.shard_map(
            lambda rows, sizes, w: lax.psum(apply(rows, sizes, **w), axis),
            in_specs=(P(), P(), specs),
            out_specs=P(),
            axis_names={axis},
        )(rows, group_sizes, weights)


class MoE(nn.Module):
    """The mixture-of-experts MLP of one block: (batch, seq, embed) -> (batch, seq, embed).
    `dense(width, name=...)` builds the model's dense MLP (the shared expert); `layers`: how
    many MoE layers the model has (the auxiliary losses are their mean); `axis_name`: the batch
    axes (jddp/models/moe.py's docstring); `expert_axis`: the one of them the experts are split
    over (jddp/models/moe_dispatch.py), where the mesh has one; `tensor_axis`, `context_axis`:
    the model's, where its mesh has them."""

    settings: MoESettings
    width: int
    gated: bool
    residual_init_std: float
    dense: Callable[..., nn.Module]
    layers: int
    axis_name: str | tuple[str, ...] | None = None
    expert_axis: str | None = None
    tensor_axis: str | None = None
    context_axis: str | None = None

    @nn.compact
    def __call__(self, x):
        s = self.settings
        batch, seq_len, embed = x.shape
        tokens = x.reshape(-1, embed)
        router = self.param("router", nn.initializers.normal(INIT_STD), (embed, s.num_experts))
        logits = tokens.astype(jnp.float32) @ router.astype(jnp.float32)
        weights, experts = route(logits, s)
        axes, one_slice = ((), ()) if self.is_initializing() else bound_axes(self.axis_name)

        expert_axis = self._expert_axis(axes)
        pairs = dispatch(
            experts.reshape(batch, seq_len, -1), s, axes, expert_axis, self._split("context")
        )
        expert_mlps = Experts(
            s.num_experts // (lax.axis_size(expert_axis) if expert_axis else 1),
            self.width,
            self.gated,
            self.residual_init_std,
            masked=bool(one_slice),
            tensor_axis=self._split("tensor"),
            name="experts",
        )
        if expert_axis:  # each pair to its expert's device and back
            outputs = moe_dispatch.exchange(
                tokens,
                pairs.order,
                pairs.kept,
                pairs.group_kept,
                s,
                expert_axis,
                pairs.global_tokens,
                expert_mlps,
            )
        else:
            outputs = expert_mlps(tokens[pairs.order // s.experts_per_token], pairs.kept)
            # Back in pair order (a dropped pair's row is zeros).
            outputs = jnp.zeros_like(outputs).at[pairs.order].set(outputs)
        # Each token's outputs summed with the router's weights.
        outputs = outputs.reshape(-1, s.experts_per_token, embed)
        y = jnp.einsum("tk,tkd->td", weights.astype(x.dtype), outputs)

        if s.shared_expert_dim:
            # On the block's input: under sequence parallelism the dense MLP takes it split.
            shared = self.dense(s.shared_expert_dim, name="shared_expert")(x)
            shared = shared.reshape(-1, embed)
            if s.shared_expert_gate:
                gate = self.param(
                    "shared_expert_gate", nn.initializers.normal(INIT_STD), (embed, 1)
                )
                shared = shared * jax.nn.sigmoid(tokens @ gate.astype(tokens.dtype))
            y = y + shared
        if not self.is_initializing():
            self._report(logits, pairs)
        return y.reshape(batch, seq_len, embed)

    def _split(self, role: str) -> str | None:
        """The model's axis of `role` ("tensor", "context") where this call runs on a mesh that
        splits over it: tensor's left to the compiler, context's by the strategy's program."""
        name = getattr(self, f"{role}_axis")
        mesh = jax.sharding.get_abstract_mesh()
        if self.is_initializing() or mesh.shape.get(name, 1) == 1:
            return None
        return name if role == "tensor" or name in mesh.manual_axes else None

    def _expert_axis(self, axes: tuple[str, ...]) -> str | None:
        """The expert axis when this program holds a share of the experts (a strategy's
        per-device step on a mesh with one); under `auto` (a slice of one) or outside a
        strategy it holds them all."""
        mesh = jax.sharding.get_abstract_mesh()
        manual = () if self.is_initializing() else mesh.manual_axes
        split = [a for a in manual if mesh.shape[a] > 1]
        if self.expert_axis is None and "expert" in split:
            raise ConfigError(
                "the mesh splits the experts over an expert axis but the model's expert_axis "
                "is not set; build it with expert_axis='expert' (jddp's config path does)"
            )
        if self.expert_axis in split and self.expert_axis not in axes:
            raise ConfigError(
                f"the model's expert axis {self.expert_axis!r} is not among its batch axes "
                f"{self.axis_name!r}; add it to batch_axis_name (jddp.batch_axis_name gives them)"
            )
        return self.expert_axis if self.expert_axis in axes else None

    def _report(self, logits, pairs: Pairs):
        """Sows the auxiliary losses (this device's share of their global means) and the
        experts' load (global already); jddp/core/sown.py."""
        s = self.settings
        fraction = lax.stop_gradient(pairs.total / pairs.global_tokens)  # f_e, global
        probs = jax.nn.softmax(logits, axis=-1)
        # E sum_e f_e P_e is linear in the tokens' probabilities: the mean of the devices'
        # shares (their own tokens' mean P_e) is the global loss, and so is its gradient.
        balance = s.num_experts * jnp.sum(fraction * probs.mean(0))
        z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        self.sow(sown.METRICS, "moe_load_balance_loss", balance)
        self.sow(sown.METRICS, "moe_z_loss", z_loss)
        self.sow(sown.METRICS, "moe_expert_load_min", fraction.min())
        self.sow(sown.METRICS, "moe_expert_load_max", fraction.max())
        if s.dispatch == "capacity":
            dropped = 1 - jnp.sum(pairs.total_kept) / jnp.sum(pairs.total)
            self.sow(sown.METRICS, "moe_dropped_fraction", dropped)
        if s.load_balance_weight or s.z_loss_weight:
            weighted = s.load_balance_weight * balance + s.z_loss_weight * z_loss
            self.sow(sown.LOSSES, "moe", weighted / self.layers)
