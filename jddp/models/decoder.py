"""What jddp's decoder language models (GPT, Llama) share: the token embedding, the stack of
pre-norm residual blocks (unrolled, or stacked for `scan_layers` and pipelines), the final norm,
the output head, and the tensor- and sequence-parallel plumbing.

Parameter names are stable for sharding rules and checkpoint conversion: `token_embed/embedding`,
`position_embed` (learned positions only), `block_{i}/{ln_1,attn,ln_2,mlp}` (stacked:
`blocks/...`), `ln_f`, `head` (untied only). Kernels are 2-D (in, out), but for a mixture of
experts' stacked experts (jddp/models/moe.py). A model says what goes in a block and which norm
it uses (`block_parts`); the rest is here.
"""

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jddp.core import layer_keys
from jddp.errors import ConfigError, ShapeError
from jddp.models import sequence_parallel
from jddp.models.moe import MoE
from jddp.models.moe_settings import moe_settings
from jddp.models.rotary import rotary
from jddp.parallel import context as context_parallel
from jddp.parallel.pipeline.layers import Pipelined

ATTENTION_IMPLS = (None, "xla", "cudnn")
INIT_STD = 0.02  # GPT-2's initializer, Llama's too
PER_LAYER, STACKED = "block_", "blocks"  # block_{i}/... per layer; blocks/... stacked


class Linear(nn.Module):
    """`nn.Dense`'s parameters and product. With `tensor_axis` set (sequence parallelism) it is
    Megatron's `split` ("column" or "row") with the collectives written out."""

    features: int
    kernel_init: Callable
    split: str | None = None
    tensor_axis: str | None = None
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
        bias = None
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        if self.tensor_axis is None or self.split is None:
            y = x @ kernel
        elif self.split == "column":
            return sequence_parallel.column_parallel(x, kernel, bias, self.tensor_axis)
        else:
            y = sequence_parallel.row_parallel(x, kernel, self.tensor_axis)
        return y if bias is None else y + bias


class Documents(NamedTuple):
    """Packed documents: each row holds several, end to end. `segment_ids` (rows, seq): 1, 2,
    ... per document, 0 for padding; attention never crosses from one id to another.
    `positions` (rows, seq): each token's position in its document, from 0 at its start
    (None: the row's). Under context parallelism, the rank's chunks of both."""

    segment_ids: jax.Array | None
    positions: jax.Array | None


def token_positions(seq_len: int, context: tuple[str, str] | None) -> jax.Array:
    """The true positions of a call's `seq_len` tokens: 0 .. seq_len - 1, or under context
    parallelism (`context` = (axis, attention)) those of the rank's two chunks."""
    if context is None:
        return jnp.arange(seq_len)
    return context_parallel.positions(seq_len, context[0])


def causal_attention(
    q,
    k,
    v,
    rope_base: float | None,
    impl: str | None,
    context=None,
    kv_split: bool = True,
    *,
    rope_scaling=None,
    window: int = 0,
    documents: Documents | None = None,
):
    """Causal softmax attention of q (batch, seq, heads, head_dim) over k, v (batch, seq,
    kv_heads, head_dim); query head n reads key/value head n // (heads / kv_heads). Rotary
    positions when `rope_base` is set, their frequencies scaled as `rope_scaling` says
    (jddp/models/rotary.py). `window` > 0: each query sees itself and the `window` - 1 keys
    before it only (transformers' sliding window). Under context parallelism (`context` =
    (axis, attention)) the sequence is the rank's two chunks and attention sees every rank's
    keys (jddp/parallel/context.py); `kv_split`: whether keys and values are split over a
    tensor axis as the queries are (else every tensor rank holds all of them). `documents`:
    packed documents' ids (no query sees another document's keys) and positions (rotary's)."""
    mesh = jax.sharding.get_abstract_mesh()
    if context and mesh.shape[context[0]] == 1:
        context = None  # a ring of one: the plain kernel holds less than the online softmax
    segments, positions = documents or (None, None)
    if positions is None:
        positions = token_positions(q.shape[1], context)
    if rope_base is not None:
        q, k = (rotary(x, positions, rope_base, rope_scaling) for x in (q, k))
    if context is None:
        # (left, right): a query at i sees keys i - left .. i (cuDNN: a window of left + 1)
        local = (window - 1, 0) if 0 < window < q.shape[1] else None
        # jax hands cuDNN a mask as an additive bias (its packed-layout offsets are not public)
        mask = None if segments is None else segments[:, None, :, None] == segments[:, None, None]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, local_window_size=local, implementation=impl
        )
    axis, how = context
    tensor = [a for a in mesh.axis_names if a not in mesh.manual_axes]
    if not tensor:
        return context_parallel.attention(q, k, v, axis, how, window, segments)
    # Heads split over tensor, which the compiler partitions: the ring runs on each tensor
    # rank's heads under a shard_map manual over it too, so its messages stay that rank's own.
    heads = P(None, None, tuple(tensor), None)

    def local(q, k, v, *segments):
        if not kv_split:  # every rank holds all key/value heads: pick its query heads' ones
            group = q.shape[2] * math.prod(mesh.shape[a] for a in tensor) // k.shape[2]
            first = lax.axis_index(tuple(tensor)) * q.shape[2]
            k, v = (jnp.take(x, (first + jnp.arange(q.shape[2])) // group, axis=2) for x in (k, v))
        return context_parallel.attention(q, k, v, axis, how, window, *segments)

    kv = heads if kv_split else P()
    ids = () if segments is None else (segments,)  # every tensor rank holds all of them
    return jax.shard_map(
        local,
        in_specs=(heads, kv, kv) + (P(),) * len(ids),
        out_specs=heads,
        axis_names=set(tensor),
        check_vma=False,
    )(q, k, v, *ids)


class Block(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)); dropout on each residual branch, drawn from
    `key` (the layer's own, so that unrolled, stacked and pipelined layers draw alike; LoRA's
    adapters inside the layer fold theirs from it, jddp/core/layer_keys.py). The model gives
    the attention, MLP and norm modules (constructors taking `name`)."""

    attention: Callable[..., nn.Module]
    mlp: Callable[..., nn.Module]
    norm: Callable[..., nn.Module]
    dropout_rate: float
    # On a tensor mesh, the residual stream's layout (Decoder._stream_spec). Pinned at each
    # sublayer, it keeps the partitioner of a whole-batch program (`auto`) from moving
    # activations across the batch axes instead of gathering the weights (a GPT at 64 rows per
    # device on fsdp:4,tensor:2: 612 MiB of collectives a step unpinned, 79 MiB pinned; zero3 82).
    stream_spec: P | None = None

    @nn.compact
    def __call__(
        self,
        x,
        train: bool,
        documents: Documents | None = None,
        key: jax.Array | None = None,
    ):
        def dropout(h, index):
            rng = None if key is None else jax.random.fold_in(key, index)
            return nn.Dropout(self.dropout_rate, deterministic=not train)(h, rng=rng)

        with layer_keys.running(key, self.path):
            x = self._pinned(x)
            attended = self.attention(name="attn")(self.norm(name="ln_1")(x), documents)
            x = self._pinned(x + dropout(attended, 0))
            return x + dropout(self.mlp(name="mlp")(self.norm(name="ln_2")(x)), 1)

    def _pinned(self, x):
        """`x` held as `stream_spec` says, where it says anything."""
        if self.stream_spec is None:
            return x
        return lax.with_sharding_constraint(x, self.stream_spec)


class Decoder(nn.Module):
    """A decoder-only transformer over int token ids (batch, seq_len), returning logits (batch,
    seq_len, vocab_size). Subclasses give `block_parts` and `hidden_dim`.

    `remat=True` recomputes each block's activations in the backward pass. `scan_layers=True`
    runs the blocks as one `nn.scan` (`jddp.parallel.pipeline.Pipelined`) with their parameters
    stacked under `blocks/` (leading axis = layer): the layout pipeline parallelism splits into
    stages (a mesh with a `stage` axis turns it on). `attention_impl`: None or "xla" (any
    device), "cudnn" (fused flash attention on NVIDIA GPUs, bfloat16 only). Dropout (on
    embeddings and residual branches, not on attention probabilities, so fused attention stays
    usable) draws from the `dropout` RNG stream.

    `tensor_axis` (set by jddp from the mesh) keeps the logits split over the vocabulary there;
    `sequence_parallel` also splits the residual stream along the sequence over it.
    `context_axis` (set by jddp from the mesh): under a strategy's step each call holds its
    context rank's two chunks of every sequence, and attention (`context_attention`: ring or
    all_gather) sees the whole sequence (jddp/parallel/context.py).

    Packed rows (several documents per row, as `data.packing` makes them): `segment_ids`
    (batch, seq_len), 1, 2, ... per document and 0 for padding, keeps every token's attention
    within its document on every path; `positions` (batch, seq_len), each token's position in
    its document, feeds the learned or rotary positions. A batch routes them with
    `input_key={"tokens": "inputs", "segment_ids": "segment_ids", "positions": "positions"}`.
    """

    vocab_size: int
    num_layers: int = 6
    num_heads: int = 6
    embed_dim: int = 384
    mlp_dim: int = 0  # 0: the model's default multiple of embed_dim
    max_seq_len: int = 256
    positions: str = "learned"
    rope_base: float = 10000.0  # rotary positions' base wavelength (Llama 3: 500000)
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    dropout_rate: float = 0.0
    remat: bool = False
    attention_impl: str | None = None
    scan_layers: bool = False
    tensor_axis: str | None = None
    sequence_parallel: bool = False
    context_axis: str | None = None
    context_attention: str = "ring"
    # A mixture of experts in every block's MLP: `model_args.moe` (jddp/models/moe_settings.py).
    moe: Any = None
    batch_axis_name: str | tuple[str, ...] | None = None  # set by jddp from the mesh
    expert_axis: str | None = None  # the mesh's expert axis (set by jddp), with `moe`

    head_bias = True  # an untied head's bias (GPT's; Llama's head has none)
    gated_mlp = False  # SwiGLU's three MLP matrices instead of two

    def __post_init__(self):
        object.__setattr__(self, "moe", moe_settings(self.moe))  # hashable, checked
        super().__post_init__()

    @property
    def kv_heads(self) -> int:
        """Key/value heads (fewer than query heads under grouped-query attention)."""
        return self.num_heads

    @property
    def head_size(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        """The MLP's width (`mlp_dim`, or the model's default for 0)."""
        raise NotImplementedError

    def block_parts(
        self, sequence_axis: str | None, tensor_size: int, context: tuple[str, str] | None
    ) -> tuple[Callable, ...]:
        """(attention, mlp, norm) module constructors of one block (each takes `name`); the
        norm is the final one's too. `context`: (axis, attention) under context parallelism."""
        raise NotImplementedError

    def mlp_part(self, dense: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        """A block's MLP constructor: `dense` (width -> the model's dense MLP) of `hidden_dim`,
        or with `moe` a mixture of experts (its shared expert a `dense` one)."""
        if self.moe is None:
            return functools.partial(dense, self.hidden_dim)
        width = self.moe.expert_dim or self.hidden_dim
        return functools.partial(
            MoE,
            self.moe,
            width,
            self.gated_mlp,
            self.residual_init_std,
            dense,
            self.num_layers,
            self.batch_axis_name,
            self.expert_axis,
            self.tensor_axis,
            self.context_axis,
        )

    @property
    def residual_init_std(self) -> float:
        """Residual projections start smaller, 0.02 / sqrt(2 x layers), as in GPT-2."""
        return INIT_STD / (2 * self.num_layers) ** 0.5

    @nn.compact
    def __call__(self, tokens, train: bool = False, *, segment_ids=None, positions=None):
        cls = type(self).__name__
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ShapeError(
                f"{cls} takes integer token ids of shape (batch, seq_len), got {tokens.dtype} "
                f"{tokens.shape}; feed the dataset's 'inputs' (input_key='inputs')"
            )
        for name, ids in (("segment_ids", segment_ids), ("positions", positions)):
            if ids is not None and ids.shape != tokens.shape:
                raise ShapeError(
                    f"{cls} takes {name} of the tokens' shape {tokens.shape}, got {ids.shape}; "
                    f"feed the packed batch's {name!r} beside its 'inputs'"
                )
        given = segment_ids is not None or positions is not None
        documents = Documents(segment_ids, positions) if given else None
        seq_len = tokens.shape[1]
        context = self._context_in_mesh()
        whole = seq_len * (jax.sharding.get_abstract_mesh().shape[context[0]] if context else 1)
        if whole > self.max_seq_len:
            raise ShapeError(
                f"sequences of {whole} tokens are longer than max_seq_len={self.max_seq_len}; "
                "raise model_args.max_seq_len or shorten data.seq_len"
            )
        embed = nn.Embed(
            self.vocab_size,
            self.embed_dim,
            embedding_init=nn.initializers.normal(INIT_STD),
            name="token_embed",
        )
        tensor_axis = self._tensor_axis_in_mesh()
        tensor_size = jax.sharding.get_abstract_mesh().shape[tensor_axis] if tensor_axis else 1
        sequence_axis = self._sequence_axis(tensor_axis, seq_len)
        if sequence_axis:  # the residual stream is split along the sequence from here on
            x = sequence_parallel.embed_tokens(tokens, embed.embedding, sequence_axis)
        else:
            x = embed(tokens)
        if self.positions == "learned":
            table = self.param(
                "position_embed",
                nn.initializers.normal(INIT_STD),
                (self.max_seq_len, self.embed_dim),
            )
            # A slice where the positions are 0 .. seq_len - 1: its backward needs no indices.
            if positions is not None:  # each packed document's own, from 0
                part = table[positions]
            elif context:
                part = table[token_positions(seq_len, context)]
            else:
                part = table[:seq_len]
            x = x + part.astype(x.dtype)
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        block_cls = nn.remat(Block, static_argnums=(2,)) if self.remat else Block
        attention, mlp, norm = self.block_parts(sequence_axis, tensor_size, context)
        stream = self._stream_spec(tensor_axis, sequence_axis)
        block = functools.partial(block_cls, attention, mlp, norm, self.dropout_rate, stream)
        # Layer i draws from fold_in(layer_key, i) however the layers are laid out.
        drawing = self.dropout_rate or layer_keys.wanted()
        layer_key = self.make_rng("dropout") if train and drawing else None
        if self.scan_layers:  # one block traced, its parameters stacked: blocks/...
            stack = Pipelined(block(name=STACKED), self.num_layers)
            x = stack(x, train, documents, layer_key=layer_key)
        else:
            for i in range(self.num_layers):
                key = None if layer_key is None else jax.random.fold_in(layer_key, i)
                x = block(name=f"{PER_LAYER}{i}")(x, train, documents, key)
        x = norm(name="ln_f")(x)
        init = nn.initializers.normal(INIT_STD)
        if self.tie_embeddings and sequence_axis:
            logits = sequence_parallel.column_parallel(x, embed.embedding.T, None, sequence_axis)
        elif self.tie_embeddings:
            logits = embed.attend(x)
        else:
            head = Linear(
                self.vocab_size, init, "column", sequence_axis, self.head_bias, name="head"
            )
            logits = head(x)
        if tensor_axis:  # no device holds whole logits: the loss is vocabulary-parallel
            # Rows and positions left to the partitioner: under `auto` they are split over the
            # batch axes, which a None here would gather.
            free = P.UNCONSTRAINED
            logits = lax.with_sharding_constraint(logits, P(free, free, tensor_axis))
        return logits

    def _tensor_axis_in_mesh(self) -> str | None:
        """`tensor_axis` when this call runs on a mesh that has it (a strategy's step); outside
        one (initialization, FLOP counting, a plain `apply`) the model runs unsplit."""
        if self.tensor_axis is None or self.is_initializing():
            return None
        mesh = jax.sharding.get_abstract_mesh()
        return self.tensor_axis if self.tensor_axis in mesh.axis_names else None

    def _context_in_mesh(self) -> tuple[str, str] | None:
        """(axis, attention) when this call holds a context rank's part of each sequence: the
        model has a `context_axis` and runs in a program manual over it (a strategy's step)."""
        if self.context_axis is None or self.is_initializing():
            return None
        mesh = jax.sharding.get_abstract_mesh()
        if self.context_axis not in mesh.manual_axes:
            return None
        return self.context_axis, self.context_attention

    @staticmethod
    def _stream_spec(tensor_axis: str | None, sequence_axis: str | None) -> P | None:
        """The residual stream's layout on a tensor mesh: rows over the batch axes the program
        splits automatically (all of them under `auto`; none where a strategy splits the batch
        by hand), the sequence over `tensor` under sequence parallelism."""
        if not tensor_axis:
            return None
        return P(sequence_parallel.row_axes(tensor_axis) or None, sequence_axis, None)

    def _sequence_axis(self, tensor_axis: str | None, seq_len: int) -> str | None:
        """The tensor axis when the sequence is split over it (sequence parallelism)."""
        if not (self.sequence_parallel and tensor_axis):
            return None
        size = jax.sharding.get_abstract_mesh().shape[tensor_axis]
        if seq_len % size:
            raise ShapeError(
                f"sequence parallelism splits sequences of {seq_len} tokens over tensor={size}; "
                f"use a data.seq_len divisible by {size}"
            )
        return self.tensor_axis


def check_common(model: Decoder, positions: tuple[str, ...]) -> None:
    """Inconsistent dimensions fail at construction, in one line naming the field to change."""
    cls = type(model).__name__
    for name in ("vocab_size", "num_layers", "num_heads", "embed_dim", "max_seq_len"):
        if getattr(model, name) < 1:
            raise ConfigError(f"{cls} {name}={getattr(model, name)} must be >= 1")
    if model.positions not in positions:
        raise ConfigError(f"{cls} positions={model.positions!r}; choose one of {positions}")
    if not 0 <= model.dropout_rate < 1:
        raise ConfigError(f"{cls} dropout_rate={model.dropout_rate} must be in [0, 1)")
    if model.mlp_dim < 0:
        raise ConfigError(f"{cls} mlp_dim={model.mlp_dim} must be >= 0 (0: the default)")
    if not model.norm_eps > 0 or not model.rope_base > 0:
        raise ConfigError(f"{cls} norm_eps and rope_base must be > 0")
    if model.attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(
            f"{cls} attention_impl={model.attention_impl!r}; choose None, 'xla' or 'cudnn'"
        )


def check_tensor_split(model: Decoder, tensor: int) -> None:
    """A ConfigError unless (query) heads, MLP units and the vocabulary split evenly over
    `tensor`."""
    sizes = {"num_heads": model.num_heads, "mlp_dim": model.hidden_dim}
    for field, size in (sizes | {"vocab_size": model.vocab_size}).items():
        if size % tensor:
            padded = -(-size // tensor) * tensor
            hint = (
                f"pad it: model_args.vocab_size={padded}"
                if field == "vocab_size"
                else f"use a multiple of {tensor}, e.g. {padded}"
            )
            raise ConfigError(
                f"{type(model).__name__} {field}={size} does not split over tensor={tensor} "
                f"(each tensor rank takes an equal part); {hint}, or change the tensor size in "
                "parallel.mesh"
            )
