"""Which Hugging Face family holds a jddp Llama: each family's own fields of `jddp.models.Llama`
(those it needs, those it may have besides), and the family an export is written as."""

from jddp.errors import ConfigError

# Each family's own fields of jddp's Llama: (those it needs, those it may have besides).
FAMILY_FIELDS = {
    "llama": ((), ("attention_bias", "mlp_bias")),
    "qwen2": (("qkv_bias",), ("sliding_window",)),
    "qwen3": (("qk_norm",), ("attention_bias", "sliding_window")),
    "mistral": ((), ("sliding_window",)),
    # with a mixture of experts (jddp/checkpoints/hf_moe.py)
    "mixtral": (("moe",), ("sliding_window",)),
    "qwen2_moe": (("moe", "shared_expert"), ("qkv_bias", "sliding_window", "unnormalized_top_k")),
    "qwen3_moe": (("moe", "qk_norm"), ("attention_bias", "sliding_window", "unnormalized_top_k")),
}


def _llama_features(model) -> set[str]:
    """The family fields `model` has on (qkv_bias counts only without attention_bias); of its
    mixture of experts, those no family has as well (topk_softmax, an ungated shared expert)."""
    moe = model.moe
    shared = bool(moe and moe.shared_expert_dim)
    on = {
        "attention_bias": model.attention_bias,
        "mlp_bias": model.mlp_bias,
        "qkv_bias": model.qkv_bias and not model.attention_bias,
        "qk_norm": model.qk_norm,
        "sliding_window": model.sliding_window > 0,
        "moe": moe is not None,
        "shared_expert": shared and moe.shared_expert_gate,
        "ungated_shared_expert": shared and not moe.shared_expert_gate,
        "unnormalized_top_k": bool(moe and not moe.normalize_top_k),
        "topk_softmax": bool(moe and moe.router_order == "topk_softmax"),
    }
    return {name for name, value in on.items() if value}


def family_of(model, preferred: str | None = None) -> str:
    """The Hugging Face family (model_type) that holds jddp's Llama `model`: `preferred` when
    it does (the checkpoint's own), else the first that does; a ConfigError when none does."""
    features = _llama_features(model)
    fitting = [
        family
        for family, (needs, may) in FAMILY_FIELDS.items()
        if set(needs) <= features <= {*needs, *may}
    ]
    if fitting:
        return preferred if preferred in fitting else fitting[0]
    families = "; ".join(
        f"{family}: " + ", ".join([*(f"{name} (needed)" for name in needs), *may])
        for family, (needs, may) in FAMILY_FIELDS.items()
    )
    raise ConfigError(
        f"this Llama has {', '.join(sorted(features))}, which no Hugging Face family jddp writes "
        f"holds ({families}); turn one of them off to export"
    )
