"""A GPT-style decoder language model: pre-LayerNorm blocks, causal self-attention, learned or
rotary positions, optionally tied input and output embeddings.

Takes int token ids (batch, seq_len) and returns logits (batch, seq_len, vocab_size). Parameter
names are stable for sharding rules: `token_embed/embedding`, `position_embed` (learned only),
`block_{i}/{ln_1,ln_2}`, `block_{i}/attn/{qkv,out}`, `block_{i}/mlp/{fc,proj}`, `ln_f`, `head`
(untied only). Kernels are 2-D (in, out).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jddp.errors import ConfigError, ShapeError

POSITIONS = ("learned", "rotary")
ATTENTION_IMPLS = (None, "xla", "cudnn")
INIT_STD = 0.02  # GPT-2's initializer


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


class CausalSelfAttention(nn.Module):
    num_heads: int
    positions: str
    residual_init_std: float
    attention_impl: str | None

    @nn.compact
    def __call__(self, x):
        batch, seq_len, width = x.shape
        head_dim = width // self.num_heads
        dense = nn.Dense(3 * width, kernel_init=nn.initializers.normal(INIT_STD), name="qkv")
        qkv = dense(x).reshape(batch, seq_len, 3, self.num_heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.positions == "rotary":
            q, k = rotary(q, jnp.arange(seq_len)), rotary(k, jnp.arange(seq_len))
        y = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=self.attention_impl
        )
        out_init = nn.initializers.normal(self.residual_init_std)
        return nn.Dense(width, kernel_init=out_init, name="out")(y.reshape(batch, seq_len, width))


class MLP(nn.Module):
    hidden_dim: int
    residual_init_std: float

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.hidden_dim, kernel_init=nn.initializers.normal(INIT_STD), name="fc")(x)
        h = nn.gelu(h, approximate=True)
        out_init = nn.initializers.normal(self.residual_init_std)
        return nn.Dense(x.shape[-1], kernel_init=out_init, name="proj")(h)


class Block(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)); dropout on each residual branch."""

    num_heads: int
    mlp_dim: int
    positions: str
    dropout_rate: float
    residual_init_std: float
    attention_impl: str | None

    @nn.compact
    def __call__(self, x, train: bool):
        dropout = nn.Dropout(self.dropout_rate, deterministic=not train)
        attn = CausalSelfAttention(
            self.num_heads, self.positions, self.residual_init_std, self.attention_impl, name="attn"
        )
        x = x + dropout(attn(nn.LayerNorm(name="ln_1")(x)))
        mlp = MLP(self.mlp_dim, self.residual_init_std, name="mlp")
        return x + dropout(mlp(nn.LayerNorm(name="ln_2")(x)))


class GPT(nn.Module):
    """Decoder-only transformer. Defaults are a small character-level model; GPT-2 small (124M)
    is `vocab_size=50257, num_layers=12, num_heads=12, embed_dim=768, max_seq_len=1024`.

    `remat=True` recomputes each block's activations in the backward pass (activation
    checkpointing). `attention_impl`: None or "xla" (any device), "cudnn" (fused flash attention
    on NVIDIA GPUs, bfloat16 only). Dropout (on embeddings and residual branches, not on attention
    probabilities, so fused attention stays usable) draws from the `dropout` RNG stream.
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
        for i in range(self.num_layers):
            x = block_cls(
                self.num_heads,
                self.mlp_dim or 4 * self.embed_dim,
                self.positions,
                self.dropout_rate,
                residual_init_std,
                self.attention_impl,
                name=f"block_{i}",
            )(x, train)
        x = nn.LayerNorm(name="ln_f")(x)
        if self.tie_embeddings:
            return embed.attend(x)
        head = nn.Dense(self.vocab_size, kernel_init=nn.initializers.normal(INIT_STD), name="head")
        return head(x)


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
