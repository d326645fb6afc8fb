"""A GPT-style decoder language model: pre-LayerNorm blocks, causal self-attention, learned or
rotary positions, optionally tied input and output embeddings.

Takes int token ids (batch, seq_len) and returns logits (batch, seq_len, vocab_size). Parameter
names are stable for sharding rules: `token_embed/embedding`, `position_embed` (learned only),
`block_{i}/{ln_1,ln_2}`, `block_{i}/attn/{qkv,out}`, `block_{i}/mlp/{fc,proj}`, `ln_f`, `head`
(untied only). Kernels are 2-D (in, out). The fused `qkv` kernel's columns are ordered head by
head (each head's q, k, v together), so a contiguous split of its columns over `tensor` gives
every tensor rank whole heads.

Tensor parallelism is Megatron-LM's (Shoeybi et al., 2019): `TENSOR_PARALLEL_RULES` split `qkv`
and `fc` by columns and `out` and `proj` by rows, the embedding and head by vocabulary; XLA's
partitioner adds the two all-reduces per block forward (and two backward). With
`sequence_parallel` the activations between those matmuls are split along the sequence too
(jddp/models/tensor_parallel.py).
"""

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jddp.errors import ConfigError, ShapeError
from jddp.models import tensor_parallel
from jddp.parallel.pipeline.layers import Pipelined

POSITIONS = ("learned", "rotary")
ATTENTION_IMPLS = (None, "xla", "cudnn")
INIT_STD = 0.02  # GPT-2's initializer
PER_LAYER, STACKED = "block_", "blocks"  # block_{i}/... per layer; blocks/... stacked

# Megatron's layout, written for a mesh with fsdp and tensor axes (axes a mesh lacks are
# dropped: jddp.parallel.rules.fit_preset). Rows or columns not split over tensor go over fsdp.
TENSOR_PARALLEL_RULES = (
    (r"token_embed/embedding$", "tensor,fsdp"),  # vocabulary-parallel embedding
    (r"attn/qkv/kernel$", "fsdp,tensor"),  # column split: whole heads per rank
    (r"attn/qkv/bias$", "tensor"),
    (r"attn/out/kernel$", "tensor,fsdp"),  # row split
    (r"mlp/fc/kernel$", "fsdp,tensor"),
    (r"mlp/fc/bias$", "tensor"),
    (r"mlp/proj/kernel$", "tensor,fsdp"),
    (r"head/kernel$", "fsdp,tensor"),  # vocabulary-parallel logits
    (r"head/bias$", "tensor"),
)


def rotary(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (Su et al., 2021) of x (batch, seq, heads, head_dim): pairs of
    channels (i, i + head_dim/2) rotated by position x frequency."""
    half = x.shape[-1] // 2
    frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * frequencies  # (seq, half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rotated.astype(x.dtype)


class Linear(nn.Module):
    """`nn.Dense`'s parameters and product. With `tensor_axis` set (sequence parallelism) it is
    Megatron's `split` ("column" or "row") with the collectives written out."""

    features: int
    kernel_init: Callable
    split: str | None = None
    tensor_axis: str | None = None

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        if self.tensor_axis is None or self.split is None:
            return x @ kernel + bias
        if self.split == "column":
            return tensor_parallel.column_parallel(x, kernel, bias, self.tensor_axis)
        return tensor_parallel.row_parallel(x, kernel, self.tensor_axis) + bias


class CausalSelfAttention(nn.Module):
    num_heads: int
    positions: str
    residual_init_std: float
    attention_impl: str | None
    sequence_axis: str | None = None  # tensor axis, when the sequence is split over it

    @nn.compact
    def __call__(self, x):
        batch, seq_len, width = x.shape
        head_dim = width // self.num_heads
        init = nn.initializers.normal(INIT_STD)
        qkv = Linear(3 * width, init, "column", self.sequence_axis, name="qkv")(x)
        qkv = qkv.reshape(batch, seq_len, self.num_heads, 3, head_dim)
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        if self.positions == "rotary":
            q, k = rotary(q, jnp.arange(seq_len)), rotary(k, jnp.arange(seq_len))
        y = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=self.attention_impl
        )
        out_init = nn.initializers.normal(self.residual_init_std)
        out = Linear(width, out_init, "row", self.sequence_axis, name="out")
        return out(y.reshape(batch, seq_len, width))


class MLP(nn.Module):
    hidden_dim: int
    residual_init_std: float
    sequence_axis: str | None = None

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(INIT_STD)
        h = Linear(self.hidden_dim, init, "column", self.sequence_axis, name="fc")(x)
        h = nn.gelu(h, approximate=True)
        out_init = nn.initializers.normal(self.residual_init_std)
        return Linear(x.shape[-1], out_init, "row", self.sequence_axis, name="proj")(h)


class Block(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)); dropout on each residual branch, drawn from
    `key` (the layer's own, so that unrolled, stacked and pipelined layers draw alike)."""

    num_heads: int
    mlp_dim: int
    positions: str
    dropout_rate: float
    residual_init_std: float
    attention_impl: str | None
    sequence_axis: str | None = None

    @nn.compact
    def __call__(self, x, train: bool, key: jax.Array | None = None):
        def dropout(h, index):
            rng = None if key is None else jax.random.fold_in(key, index)
            return nn.Dropout(self.dropout_rate, deterministic=not train)(h, rng=rng)

        attn = CausalSelfAttention(
            self.num_heads,
            self.positions,
            self.residual_init_std,
            self.attention_impl,
            self.sequence_axis,
            name="attn",
        )
        x = x + dropout(attn(nn.LayerNorm(name="ln_1")(x)), 0)
        mlp = MLP(self.mlp_dim, self.residual_init_std, self.sequence_axis, name="mlp")
        return x + dropout(mlp(nn.LayerNorm(name="ln_2")(x)), 1)


class GPT(nn.Module):
    """Decoder-only transformer. Defaults are a small character-level model; GPT-2 small (124M)
    is `vocab_size=50257, num_layers=12, num_heads=12, embed_dim=768, max_seq_len=1024`.

    `remat=True` recomputes each block's activations in the backward pass (activation
    checkpointing). `scan_layers=True` runs the blocks as one `nn.scan`
    (`jddp.parallel.pipeline.Pipelined`) with their parameters stacked under `blocks/` (leading axis
    = layer): one block is compiled instead of `num_layers`, and it is the layout pipeline
    parallelism splits into stages (a mesh with a `stage` axis turns it on). `attention_impl`: None
    or "xla" (any device), "cudnn" (fused flash attention on NVIDIA GPUs, bfloat16 only). Dropout
    (on embeddings and residual branches, not on attention probabilities, so fused attention stays
    usable) draws from the `dropout` RNG stream.

    `tensor_axis` (set by jddp from the mesh) keeps the logits split over the vocabulary there;
    `sequence_parallel` also splits the residual stream along the sequence over it.
    """

    vocab_size: int
    num_layers: int = 6
    num_heads: int = 6
    embed_dim: int = 384
    mlp_dim: int = 0  # 0 = 4 x embed_dim
    max_seq_len: int = 256
    positions: str = "learned"
    tie_embeddings: bool = True
    dropout_rate: float = 0.0
    remat: bool = False
    attention_impl: str | None = None
    scan_layers: bool = False
    tensor_axis: str | None = None
    sequence_parallel: bool = False

    def __post_init__(self):
        _check_dimensions(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ShapeError(
                f"GPT takes integer token ids of shape (batch, seq_len), got {tokens.dtype} "
                f"{tokens.shape}; feed the dataset's 'inputs' (input_key='inputs')"
            )
        seq_len = tokens.shape[1]
        if seq_len > self.max_seq_len:
            raise ShapeError(
                f"sequences of {seq_len} tokens are longer than max_seq_len={self.max_seq_len} "
                "(the position table); raise model_args.max_seq_len or shorten data.seq_len"
            )
        embed = nn.Embed(
            self.vocab_size,
            self.embed_dim,
            embedding_init=nn.initializers.normal(INIT_STD),
            name="token_embed",
        )
        tensor_axis = self._tensor_axis_in_mesh()
        sequence_axis = self._sequence_axis(tensor_axis, seq_len)
        if sequence_axis:  # the residual stream is split along the sequence from here on
            x = tensor_parallel.embed_tokens(tokens, embed.embedding, sequence_axis)
        else:
            x = embed(tokens)
        if self.positions == "learned":
            table = self.param(
                "position_embed",
                nn.initializers.normal(INIT_STD),
                (self.max_seq_len, self.embed_dim),
            )
            x = x + table[:seq_len].astype(x.dtype)
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        # Residual projections start smaller, 0.02 / sqrt(2 x layers), as in GPT-2.
        residual_init_std = INIT_STD / (2 * self.num_layers) ** 0.5
        block_cls = nn.remat(Block, static_argnums=(2,)) if self.remat else Block
        block = functools.partial(
            block_cls,
            self.num_heads,
            self.mlp_dim or 4 * self.embed_dim,
            self.positions,
            self.dropout_rate,
            residual_init_std,
            self.attention_impl,
            sequence_axis,
        )
        # Layer i draws from fold_in(layer_key, i) however the layers are laid out.
        layer_key = self.make_rng("dropout") if train and self.dropout_rate else None
        if self.scan_layers:  # one block traced, its parameters stacked: blocks/...
            x = Pipelined(block(name=STACKED), self.num_layers)(x, train, layer_key=layer_key)
        else:
            for i in range(self.num_layers):
                key = None if layer_key is None else jax.random.fold_in(layer_key, i)
                x = block(name=f"{PER_LAYER}{i}")(x, train, key)
        x = nn.LayerNorm(name="ln_f")(x)
        init = nn.initializers.normal(INIT_STD)
        if self.tie_embeddings and sequence_axis:
            logits = tensor_parallel.column_parallel(x, embed.embedding.T, None, sequence_axis)
        elif self.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = Linear(self.vocab_size, init, "column", sequence_axis, name="head")(x)
        if tensor_axis:  # no device holds whole logits: the loss is vocabulary-parallel
            logits = lax.with_sharding_constraint(logits, P(None, None, tensor_axis))
        return logits

    def _tensor_axis_in_mesh(self) -> str | None:
        """`tensor_axis` when this call runs on a mesh that has it (a strategy's step); outside
        one (initialization, FLOP counting, a plain `apply`) the model runs unsplit."""
        if self.tensor_axis is None or self.is_initializing():
            return None
        mesh = jax.sharding.get_abstract_mesh()
        return self.tensor_axis if self.tensor_axis in mesh.axis_names else None

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


def _check_dimensions(model: GPT) -> None:
    """Inconsistent dimensions fail at construction, in one line naming the field to change."""
    for name in ("vocab_size", "num_layers", "num_heads", "embed_dim", "max_seq_len"):
        if getattr(model, name) < 1:
            raise ConfigError(f"GPT {name}={getattr(model, name)} must be >= 1")
    if model.embed_dim % model.num_heads:
        divisors = [h for h in range(1, model.embed_dim + 1) if model.embed_dim % h == 0]
        below = max(h for h in divisors if h < model.num_heads)
        above = [h for h in divisors if h > model.num_heads][:1]
        raise ConfigError(
            f"GPT num_heads={model.num_heads} does not divide embed_dim={model.embed_dim}; "
            f"use num_heads {' or '.join(map(str, [below, *above]))}, or change embed_dim"
        )
    if model.positions not in POSITIONS:
        raise ConfigError(f"GPT positions={model.positions!r}; choose one of {POSITIONS}")
    if model.positions == "rotary" and (model.embed_dim // model.num_heads) % 2:
        raise ConfigError(
            f"rotary positions need an even head size, got embed_dim / num_heads = "
            f"{model.embed_dim} / {model.num_heads}; change num_heads or embed_dim"
        )
    if not 0 <= model.dropout_rate < 1:
        raise ConfigError(f"GPT dropout_rate={model.dropout_rate} must be in [0, 1)")
    if model.mlp_dim < 0:
        raise ConfigError(f"GPT mlp_dim={model.mlp_dim} must be >= 0 (0: 4 x embed_dim)")
    if model.attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(
            f"GPT attention_impl={model.attention_impl!r}; choose None, 'xla' or 'cudnn'"
        )
