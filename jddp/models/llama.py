"""A Llama-family decoder language model: RMSNorm, a SwiGLU MLP, rotary positions with a
configurable base and scaling (jddp/models/rotary.py), grouped-query attention (`num_kv_heads`),
tied or untied embeddings, optional attention and MLP biases, biases on q, k and v only, per-head
RMSNorm on queries and keys, a sliding attention window. Those few orthogonal fields cover
Hugging Face's Llama, Qwen2, Qwen3 and Mistral (`jddp.checkpoints.hf` reads and writes their
checkpoints).

Parameter names (jddp/models/decoder.py): `block_{i}/attn/{q,k,v,out,q_norm,k_norm}`,
`block_{i}/mlp/{gate,up,proj}`, `block_{i}/{ln_1,ln_2}`, `token_embed`, `ln_f`, `head`.

Tensor parallelism is Megatron's, as GPT's: queries, gate and up split by columns (whole heads,
whole MLP units per rank), `out` and `proj` by rows, the embedding and head by vocabulary. Keys and
values split by heads when `num_kv_heads` divides over `tensor`; otherwise every tensor rank holds
all of them (their kernels are replicated over `tensor`, split over `fsdp` only) and attends its
query heads to the key/value heads they read (`tensor_parallel_rules`).
"""

import functools
from collections.abc import Mapping

import flax.linen as nn
import jax

from jddp.errors import ConfigError
from jddp.models import rotary
from jddp.models.decoder import INIT_STD, Decoder, Linear, causal_attention, check_common


def tensor_parallel_rules(num_kv_heads: int, tensor: int) -> tuple[tuple[str, str], ...]:
    """Megatron's layout for a Llama with `num_kv_heads` key/value heads on `tensor` ranks."""
    kv_split = num_kv_heads % tensor == 0
    return (
        (r"token_embed/embedding$", "tensor,fsdp"),  # vocabulary-parallel embedding
        (r"attn/q/kernel$", "fsdp,tensor"),  # column split: whole query heads per rank
        (r"attn/q/bias$", "tensor"),
        (r"attn/[kv]/kernel$", "fsdp,tensor" if kv_split else "fsdp"),
        (r"attn/[kv]/bias$", "tensor" if kv_split else "replicate"),
        (r"attn/out/kernel$", "tensor,fsdp"),  # row split
        (r"mlp/(shared_expert/)?(gate|up)/kernel$", "fsdp,tensor"),
        (r"mlp/(shared_expert/)?(gate|up)/bias$", "tensor"),
        (r"mlp/(shared_expert/)?proj/kernel$", "tensor,fsdp"),
        (r"mlp/experts/(gate|up)$", "fsdp,tensor"),  # each expert's matrix (parallel/rules.py)
        (r"mlp/experts/down$", "tensor,fsdp"),
        (r"head/kernel$", "fsdp,tensor"),  # vocabulary-parallel logits
    )


class GroupedQueryAttention(nn.Module):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_base: float
    use_bias: bool
    residual_init_std: float
    attention_impl: str | None
    sequence_axis: str | None = None  # tensor axis, when the sequence is split over it
    kv_split: bool = True  # key/value heads split over tensor (else every rank has all)
    context: tuple[str, str] | None = None  # (axis, attention) under context parallelism
    qkv_bias: bool = False  # biases on q, k and v (all four: use_bias)
    qk_norm_eps: float | None = None  # per-head RMSNorm of queries and keys, with this epsilon
    rope_scaling: Mapping | None = None
    window: int = 0  # sliding window (0: none)

    @nn.compact
    def __call__(self, x, documents=None):
        batch, seq_len, width = x.shape
        init = nn.initializers.normal(INIT_STD)
        axis, bias = self.sequence_axis, self.use_bias or self.qkv_bias
        kv_split = "column" if self.kv_split else None  # None: replicated, XLA gathers x

        def project(name, heads, split):
            y = Linear(heads * self.head_dim, init, split, axis, bias, name=name)(x)
            y = y.reshape(batch, seq_len, heads, self.head_dim)
            if self.qk_norm_eps is not None and name != "v":  # Qwen3's, before rotary
                y = nn.RMSNorm(epsilon=self.qk_norm_eps, name=f"{name}_norm")(y)
            return y

        q = project("q", self.num_heads, "column")
        k = project("k", self.num_kv_heads, kv_split)
        v = project("v", self.num_kv_heads, kv_split)
        y = causal_attention(
            q,
            k,
            v,
            self.rope_base,
            self.attention_impl,
            self.context,
            self.kv_split,
            rope_scaling=self.rope_scaling,
            window=self.window,
            documents=documents,
        ).reshape(batch, seq_len, self.num_heads * self.head_dim)
        out_init = nn.initializers.normal(self.residual_init_std)
        return Linear(width, out_init, "row", axis, self.use_bias, name="out")(y)


class SwiGLU(nn.Module):
    """proj(silu(gate(x)) * up(x)) (Shazeer, 2020)."""

    hidden_dim: int
    use_bias: bool
    residual_init_std: float
    sequence_axis: str | None = None

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(INIT_STD)
        axis, bias = self.sequence_axis, self.use_bias
        gate = Linear(self.hidden_dim, init, "column", axis, bias, name="gate")(x)
        up = Linear(self.hidden_dim, init, "column", axis, bias, name="up")(x)
        out_init = nn.initializers.normal(self.residual_init_std)
        proj = Linear(x.shape[-1], out_init, "row", axis, bias, name="proj")
        return proj(jax.nn.silu(gate) * up)


class Llama(Decoder):
    """Llama-family decoder. `num_kv_heads=0` is `num_heads` (no grouping), 1 is multi-query;
    `head_dim=0` is embed_dim / num_heads; `mlp_dim=0` is Llama's 8/3 x embed_dim rounded up to a
    multiple of 256. Positions are rotary only (`rope_base`, scaled as `rope_scaling` says:
    jddp/models/rotary.py); `max_seq_len` is the longest sequence accepted. `qkv_bias`: biases
    on q, k and v only (Qwen2); `qk_norm`: RMSNorm over each head's queries and keys before
    rotary (Qwen3); `sliding_window` > 0: each token attends to itself and the
    `sliding_window` - 1 tokens before it (Mistral). The rest: `jddp.models.decoder.Decoder`."""

    positions: str = "rotary"
    tie_embeddings: bool = False
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False  # biases on q, k, v and out
    mlp_bias: bool = False  # biases on gate, up and proj
    qkv_bias: bool = False  # biases on q, k and v only
    qk_norm: bool = False  # per-head RMSNorm on queries and keys: attn/{q,k}_norm/scale
    rope_scaling: Mapping | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    sliding_window: int = 0  # 0: every earlier token

    head_bias = False
    gated_mlp = True

    def __post_init__(self):
        _check_dimensions(self)
        # A hashable mapping (Linen modules hash their fields), from a dict or a ConfigDict.
        object.__setattr__(self, "rope_scaling", rotary.check_scaling(self.rope_scaling))
        super().__post_init__()

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.embed_dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        return self.mlp_dim or -(-8 * self.embed_dim // 3 // 256) * 256

    def block_parts(self, sequence_axis, tensor_size, context):
        std = self.residual_init_std
        attention = functools.partial(
            GroupedQueryAttention,
            self.num_heads,
            self.kv_heads,
            self.head_size,
            self.rope_base,
            self.attention_bias,
            std,
            self.attention_impl,
            sequence_axis,
            self.kv_heads % tensor_size == 0,
            context,
            qkv_bias=self.qkv_bias,
            qk_norm_eps=self.norm_eps if self.qk_norm else None,
            rope_scaling=self.rope_scaling,
            window=self.sliding_window,
        )
        mlp = self.mlp_part(
            functools.partial(
                SwiGLU, use_bias=self.mlp_bias, residual_init_std=std, sequence_axis=sequence_axis
            )
        )
        return attention, mlp, functools.partial(nn.RMSNorm, epsilon=self.norm_eps)


def _check_dimensions(model: Llama) -> None:
    check_common(model, ("rotary",))
    for name in ("num_kv_heads", "head_dim", "sliding_window"):
        if getattr(model, name) < 0:
            raise ConfigError(f"Llama {name}={getattr(model, name)} must be >= 0 (0: the default)")
    if not model.head_dim and model.embed_dim % model.num_heads:
        raise ConfigError(
            f"Llama num_heads={model.num_heads} does not divide embed_dim={model.embed_dim}; "
            "change num_heads, or set head_dim"
        )
    if model.num_heads % model.kv_heads:
        raise ConfigError(
            f"Llama num_kv_heads={model.kv_heads} does not divide num_heads={model.num_heads} "
            "(each key/value head serves an equal group of query heads); change one of them"
        )
    if model.head_size % 2:
        raise ConfigError(
            f"rotary positions need an even head size, got {model.head_size}; change num_heads, "
            "embed_dim or head_dim"
        )
