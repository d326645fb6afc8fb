"""A GPT-style decoder language model: pre-LayerNorm blocks, causal self-attention, learned or
rotary positions, tanh-approximated GELU, biases, optionally tied input and output embeddings
(GPT-2's layout; `jddp.checkpoints.hf` reads and writes GPT-2 checkpoints).

Parameter names (jddp/models/decoder.py): `block_{i}/attn/{qkv,out}`, `block_{i}/mlp/{fc,proj}`,
`block_{i}/{ln_1,ln_2}`, `token_embed`, `position_embed`, `ln_f`, `head`. The fused `qkv`
kernel's columns are ordered head by head (each head's q, k, v together), so a contiguous split of
its columns over `tensor` gives every tensor rank whole heads.

Tensor parallelism is Megatron-LM's (Shoeybi et al., 2019): `TENSOR_PARALLEL_RULES` split `qkv`
and `fc` by columns and `out` and `proj` by rows, the embedding and head by vocabulary; XLA's
partitioner adds the two all-reduces per block forward (and two backward). With
`sequence_parallel` the activations between those matmuls are split along the sequence too
(jddp/models/sequence_parallel.py).
"""

import functools

import flax.linen as nn

from jddp.errors import ConfigError
from jddp.models.decoder import (
    ATTENTION_IMPLS,  # noqa: F401  (re-exported: the options GPT's attention_impl takes)
    INIT_STD,
    PER_LAYER,  # noqa: F401
    STACKED,  # noqa: F401
    Decoder,
    Linear,
    causal_attention,
    check_common,
    rotary,  # noqa: F401
)

POSITIONS = ("learned", "rotary")

# Megatron's layout, written for a mesh with fsdp and tensor axes (axes a mesh lacks are
# dropped: jddp.parallel.rules.adapt_preset). Rows or columns not split over tensor go over fsdp.
TENSOR_PARALLEL_RULES = (
    (r"token_embed/embedding$", "tensor,fsdp"),  # vocabulary-parallel embedding
    (r"attn/qkv/kernel$", "fsdp,tensor"),  # column split: whole heads per rank
    (r"attn/qkv/bias$", "tensor"),
    (r"attn/out/kernel$", "tensor,fsdp"),  # row split
    (r"mlp/(shared_expert/)?fc/kernel$", "fsdp,tensor"),
    (r"mlp/(shared_expert/)?fc/bias$", "tensor"),
    (r"mlp/(shared_expert/)?proj/kernel$", "tensor,fsdp"),
    (r"mlp/experts/up$", "fsdp,tensor"),  # each expert's matrix (parallel/rules.py)
    (r"mlp/experts/down$", "tensor,fsdp"),
    (r"head/kernel$", "fsdp,tensor"),  # vocabulary-parallel logits
    (r"head/bias$", "tensor"),
)


class CausalSelfAttention(nn.Module):
    num_heads: int
    rope_base: float | None  # None: no rotary positions
    residual_init_std: float
    attention_impl: str | None
    sequence_axis: str | None = None  # tensor axis, when the sequence is split over it
    context: tuple[str, str] | None = None  # (axis, attention) under context parallelism

    @nn.compact
    def __call__(self, x, documents=None):
        batch, seq_len, width = x.shape
        head_dim = width // self.num_heads
        init = nn.initializers.normal(INIT_STD)
        qkv = Linear(3 * width, init, "column", self.sequence_axis, name="qkv")(x)
        qkv = qkv.reshape(batch, seq_len, self.num_heads, 3, head_dim)
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        y = causal_attention(
            q, k, v, self.rope_base, self.attention_impl, self.context, documents=documents
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


class GPT(Decoder):
    """Decoder-only transformer. Defaults are a small character-level model; GPT-2 small (124M)
    is `vocab_size=50257, num_layers=12, num_heads=12, embed_dim=768, max_seq_len=1024,
    norm_eps=1e-5`. `mlp_dim=0` is 4 x embed_dim. The rest: `jddp.models.decoder.Decoder`."""

    def __post_init__(self):
        _check_dimensions(self)
        super().__post_init__()

    def block_parts(self, sequence_axis, tensor_size, context):
        rope_base = self.rope_base if self.positions == "rotary" else None
        std = self.residual_init_std
        attention = functools.partial(
            CausalSelfAttention,
            self.num_heads,
            rope_base,
            std,
            self.attention_impl,
            sequence_axis,
            context,
        )
        mlp = self.mlp_part(
            functools.partial(MLP, residual_init_std=std, sequence_axis=sequence_axis)
        )
        return attention, mlp, functools.partial(nn.LayerNorm, epsilon=self.norm_eps)

    @property
    def hidden_dim(self) -> int:
        return self.mlp_dim or 4 * self.embed_dim


def _check_dimensions(model: GPT) -> None:
    check_common(model, POSITIONS)
    if model.embed_dim % model.num_heads:
        divisors = [h for h in range(1, model.embed_dim + 1) if model.embed_dim % h == 0]
        below = max(h for h in divisors if h < model.num_heads)
        above = [h for h in divisors if h > model.num_heads][:1]
        raise ConfigError(
            f"GPT num_heads={model.num_heads} does not divide embed_dim={model.embed_dim}; "
            f"use num_heads {' or '.join(map(str, [below, *above]))}, or change embed_dim"
        )
    if model.positions == "rotary" and (model.embed_dim // model.num_heads) % 2:
        raise ConfigError(
            f"rotary positions need an even head size, got embed_dim / num_heads = "
            f"{model.embed_dim} / {model.num_heads}; change num_heads or embed_dim"
        )
