"""How jddp's decoders and Hugging Face's causal language models name and lay out the same
weights: `config.json` <-> a jddp model's arguments, and each jddp parameter <-> one tensor of
`model.safetensors`, with the transform between them.

Llama (`LlamaForCausalLM`, model_type "llama"), Qwen2 / Qwen2.5 ("qwen2": biases on q, k and v),
Qwen3 ("qwen3": RMSNorm on each head's queries and keys) and Mistral ("mistral": a sliding window)
are jddp's `llama` with those fields on, and Mixtral, Qwen2-MoE and Qwen3-MoE the same with a
mixture of experts (`moe`: jddp/checkpoints/hf_moe.py); an export is written as the family that
holds the model's fields (jddp/checkpoints/hf_families.py). GPT-2 (`GPT2LMHeadModel`,
model_type "gpt2") is jddp's `gpt` with learned positions and tied embeddings. The transforms
between the layouts: jddp/checkpoints/hf_mapping.py.
"""

import dataclasses
import functools
from collections.abc import Callable

from jddp.checkpoints import hf_moe
from jddp.checkpoints.hf_families import family_of
from jddp.checkpoints.hf_mapping import QKV_BY_HEAD, TRANSPOSE, Tensor, count, require
from jddp.errors import ConfigError
from jddp.models import rotary


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A Hugging Face model family jddp reads and writes."""

    model_type: str  # config.json's "model_type"
    hf_class: str  # config.json's "architectures"
    model: str  # jddp's model name
    model_args: Callable[[dict], dict]  # config.json -> jddp model arguments
    hf_config: Callable[[object], dict]  # jddp model -> config.json
    tensors: Callable[[object], list[Tensor]]  # jddp model -> its parameters' tensors


# ------------------------------------------------------------------- Llama, Qwen2, Qwen3, Mistral
# One jddp model, `llama`, whose few orthogonal fields cover the four families (and with `moe`,
# the three MoE ones); their tensors are named alike (`_llama_tensors`), but for the experts'.
ROPE_TYPES = ("default", *rotary.SCALINGS)
_LENGTH = "max_position_embeddings"


def _rope(hf: dict, where: str) -> dict:
    """rope_base and rope_scaling from transformers 5's `rope_parameters` or older files'
    `rope_theta` and `rope_scaling`; a ConfigError for a type jddp lacks."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(
            f"{where} has rope_parameters per layer type ({', '.join(rope)}); jddp's Llama "
            "uses one rotary embedding for every layer"
        )
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    read = {"rope_type": kind, "partial_rotary_factor": partial}
    require(read, where, rope_type=ROPE_TYPES, partial_rotary_factor=(1.0,))
    args = {"rope_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind != "default":
        required, optional = rotary.SCALINGS[kind]
        scaling = {"rope_type": kind} | {k: rope[k] for k in required + optional if k in rope}
        if "original_max_position_embeddings" in required:  # transformers' fallbacks
            context = hf.get("original_max_position_embeddings")
            scaling.setdefault("original_max_position_embeddings", context or hf.get(_LENGTH))
        args["rope_scaling"] = dict(rotary.check_scaling(scaling, f"{where}'s rope_parameters"))
    return args


def _rope_parameters(model) -> dict:
    return {"rope_type": "default", "rope_theta": model.rope_base} | dict(model.rope_scaling or {})


def _qwen_window(hf: dict, where: str) -> int:
    """Qwen2's and Qwen3's sliding window: off unless `use_sliding_window`, then on the layers
    `layer_types` names (by default those from `max_window_layers` on)."""
    hf = {"sliding_window": 4096, "max_window_layers": 28} | hf  # Qwen2Config's defaults
    window = hf["sliding_window"] if hf.get("use_sliding_window") else None
    if window is None:
        return 0
    layers = count(hf, "num_hidden_layers", where)
    first = hf["max_window_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(layers)
    ]
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {True, False}:
        raise ConfigError(
            f"{where} slides its attention window on some layers only (layer_types, "
            f"max_window_layers={first}); jddp's Llama applies one window to every layer: "
            "set max_window_layers to 0 (all) or num_hidden_layers (none)"
        )
    return count(hf, "sliding_window", where) if sliding == {True} else 0


def _llama_args(hf: dict, where: str) -> dict:
    """The arguments every family shares, Llama's biases, and no window (transformers' Llama
    reads none)."""
    require(hf, where, hidden_act=("silu",))
    heads, width = count(hf, "num_attention_heads", where), count(hf, "hidden_size", where)
    args = {
        "vocab_size": count(hf, "vocab_size", where),
        "num_layers": count(hf, "num_hidden_layers", where),
        "num_heads": heads,
        "num_kv_heads": count(hf, "num_key_value_heads", where, heads),
        "embed_dim": width,
        "mlp_dim": count(hf, "intermediate_size", where),
        "max_seq_len": count(hf, "max_position_embeddings", where, 2048),
        **_rope(hf, where),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": bool(hf.get("attention_bias", False)),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }
    head_dim = count(hf, "head_dim", where, width // heads)
    if head_dim * heads != width:
        args["head_dim"] = head_dim
    return args


def _qwen2_args(hf: dict, where: str) -> dict:
    args = _llama_args(hf, where) | {"attention_bias": False, "mlp_bias": False}
    return args | {"qkv_bias": True, "sliding_window": _qwen_window(hf, where)}


def _qwen3_args(hf: dict, where: str) -> dict:
    hf = {"head_dim": 128} | hf  # Qwen3Config's default
    args = _llama_args(hf, where) | {"mlp_bias": False, "qk_norm": True}
    return args | {"sliding_window": _qwen_window(hf, where)}


def _mistral_args(hf: dict, where: str) -> dict:
    hf = {"sliding_window": 4096} | hf  # MistralConfig's default; null: no window
    window = count(hf, "sliding_window", where) if hf["sliding_window"] is not None else 0
    args = _llama_args(hf, where) | {"attention_bias": False, "mlp_bias": False}
    return args | {"sliding_window": window}


# Mixtral, Qwen2-MoE, Qwen3-MoE: their dense family's attention, experts in every MLP.
def _mixtral_args(hf: dict, where: str) -> dict:
    hf = {"sliding_window": None} | hf  # MixtralConfig's default
    return _mistral_args(hf, where) | {"moe": hf_moe.settings(hf, where, "mixtral")}


def _qwen2_moe_args(hf: dict, where: str) -> dict:
    if hf.get("use_sliding_window") and not hf.get("layer_types"):  # Qwen2MoeConfig's rule
        first = hf.get("max_window_layers", 28)
        sliding = [i % 2 == 0 and i < first for i in range(count(hf, "num_hidden_layers", where))]
        if len(set(sliding)) > 1:
            raise ConfigError(
                f"{where} slides its attention window on every other layer below "
                f"max_window_layers={first} (Qwen2-MoE's use_sliding_window); jddp's Llama "
                "applies one window to every layer: set layer_types (all 'sliding_attention') "
                "or use_sliding_window false"
            )
        hf = hf | {"layer_types": [("sliding" if s else "full") + "_attention" for s in sliding]}
    args = _qwen2_args(hf, where) | {"qkv_bias": bool(hf.get("qkv_bias", True))}
    return args | {"moe": hf_moe.settings(hf, where, "qwen2_moe")}


def _qwen3_moe_args(hf: dict, where: str) -> dict:
    """Qwen3's attention, but a window on every layer or none, and head_dim's default
    hidden_size / num_attention_heads (Qwen3MoeConfig's)."""
    window = count(hf, "sliding_window", where) if hf.get("use_sliding_window") else 0
    args = _llama_args(hf, where) | {"mlp_bias": False, "qk_norm": True}
    return args | {"sliding_window": window, "moe": hf_moe.settings(hf, where, "qwen3_moe")}


def _family_config(model_type: str, hf_class: str, model) -> dict:
    """config.json of jddp's Llama `model` as the family `model_type`."""
    common = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed_dim,
        "intermediate_size": model.hidden_dim,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_parameters": _rope_parameters(model),
        "tie_word_embeddings": model.tie_embeddings,
        "attention_dropout": 0.0,
    }
    window, layers = model.sliding_window or None, model.num_layers
    qwen_window = {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window else layers,
        "layer_types": [("sliding" if window else "full") + "_attention"] * layers,
    }
    qwen3_moe_window = {"use_sliding_window": window is not None, "sliding_window": window}
    own = {
        "llama": {"attention_bias": model.attention_bias, "mlp_bias": model.mlp_bias},
        "qwen2": qwen_window,
        "qwen3": {"attention_bias": model.attention_bias} | qwen_window,
        "mistral": {"sliding_window": window},
        "mixtral": {"sliding_window": window},
        "qwen2_moe": qwen_window | {"qkv_bias": model.qkv_bias},
        "qwen3_moe": {"attention_bias": model.attention_bias} | qwen3_moe_window,
    }
    experts = hf_moe.config(model, model_type) if model.moe else {}
    return common | own[model_type] | experts


def _llama_tensors(model) -> list[Tensor]:
    found = [Tensor("token_embed/embedding", "model.embed_tokens.weight")]
    linears = {"attn": ("q", "k", "v", "out"), "mlp": () if model.moe else ("gate", "up", "proj")}
    # An MoE model's experts are named as the one MoE family that holds its fields names them.
    moe_family = family_of(model) if model.moe else None
    hf_linear = {"out": "o_proj", "proj": "down_proj"}
    qkv_bias = model.attention_bias or model.qkv_bias
    biases = {"q": qkv_bias, "k": qkv_bias, "v": qkv_bias, "out": model.attention_bias}
    for i in range(model.num_layers):
        ours, theirs = f"block_{i}", f"model.layers.{i}"
        found.append(Tensor(f"{ours}/ln_1/scale", f"{theirs}.input_layernorm.weight"))
        found.append(Tensor(f"{ours}/ln_2/scale", f"{theirs}.post_attention_layernorm.weight"))
        for part, names in linears.items():
            hf_part = "self_attn" if part == "attn" else "mlp"
            for name in names:
                hf_name = f"{theirs}.{hf_part}.{hf_linear.get(name, f'{name}_proj')}"
                found.append(Tensor(f"{ours}/{part}/{name}/kernel", f"{hf_name}.weight", TRANSPOSE))
                if biases.get(name, model.mlp_bias):
                    found.append(Tensor(f"{ours}/{part}/{name}/bias", f"{hf_name}.bias"))
        if model.qk_norm:
            for norm in ("q_norm", "k_norm"):
                hf_name = f"{theirs}.self_attn.{norm}.weight"
                found.append(Tensor(f"{ours}/attn/{norm}/scale", hf_name))
        if moe_family:
            found += hf_moe.tensors(model, moe_family, ours, theirs)
    found.append(Tensor("ln_f/scale", "model.norm.weight"))
    if not model.tie_embeddings:
        found.append(Tensor("head/kernel", "lm_head.weight", TRANSPOSE))
    return found


# ------------------------------------------------------------------------------------ GPT-2
def _gpt2_args(hf: dict, where: str) -> dict:
    require(
        hf,
        where,
        activation_function=("gelu_new", "gelu_pytorch_tanh"),
        scale_attn_weights=(True,),
        scale_attn_by_inverse_layer_idx=(False,),
        tie_word_embeddings=(True,),
    )
    width = count(hf, "n_embd", where)
    return {
        "vocab_size": count(hf, "vocab_size", where),
        "num_layers": count(hf, "n_layer", where),
        "num_heads": count(hf, "n_head", where),
        "embed_dim": width,
        "mlp_dim": count(hf, "n_inner", where, 4 * width),
        "max_seq_len": count(hf, "n_positions", where),
        "positions": "learned",
        "tie_embeddings": True,
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
    }


def _gpt2_config(model) -> dict:
    if model.positions != "learned" or not model.tie_embeddings:
        raise ConfigError(
            "GPT-2's layout has learned positions and tied embeddings; this GPT has "
            f"positions={model.positions!r}, tie_embeddings={model.tie_embeddings}, which no "
            "Hugging Face GPT-2 reads"
        )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_embd": model.embed_dim,
        "n_layer": model.num_layers,
        "n_head": model.num_heads,
        "n_inner": model.hidden_dim,
        "n_positions": model.max_seq_len,
        "layer_norm_epsilon": model.norm_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


def _gpt2_tensors(model) -> list[Tensor]:
    found = [
        Tensor("token_embed/embedding", "transformer.wte.weight"),
        Tensor("position_embed", "transformer.wpe.weight"),
    ]
    layers = {
        "ln_1": "ln_1",
        "ln_2": "ln_2",
        "attn/qkv": "attn.c_attn",
        "attn/out": "attn.c_proj",
        "mlp/fc": "mlp.c_fc",
        "mlp/proj": "mlp.c_proj",
    }
    for i in range(model.num_layers):
        for ours, theirs in layers.items():
            transform, heads = (QKV_BY_HEAD, model.num_heads) if ours == "attn/qkv" else ("", 0)
            weight = "scale" if ours.startswith("ln") else "kernel"
            prefix, hf_prefix = f"block_{i}/{ours}", f"transformer.h.{i}.{theirs}"
            found.append(Tensor(f"{prefix}/{weight}", f"{hf_prefix}.weight", transform, heads))
            found.append(Tensor(f"{prefix}/bias", f"{hf_prefix}.bias", transform, heads))
    found += [Tensor("ln_f/scale", "transformer.ln_f.weight")]
    found += [Tensor("ln_f/bias", "transformer.ln_f.bias")]
    return found


def _family(model_type: str, hf_class: str, args: Callable[[dict, str], dict]) -> Architecture:
    config = functools.partial(_family_config, model_type, hf_class)
    return Architecture(model_type, hf_class, "llama", args, config, _llama_tensors)


ARCHITECTURES = {
    "llama": _family("llama", "LlamaForCausalLM", _llama_args),
    "qwen2": _family("qwen2", "Qwen2ForCausalLM", _qwen2_args),
    "qwen3": _family("qwen3", "Qwen3ForCausalLM", _qwen3_args),
    "mistral": _family("mistral", "MistralForCausalLM", _mistral_args),
    "mixtral": _family("mixtral", "MixtralForCausalLM", _mixtral_args),
    "qwen2_moe": _family("qwen2_moe", "Qwen2MoeForCausalLM", _qwen2_moe_args),
    "qwen3_moe": _family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_args),
    "gpt2": Architecture("gpt2", "GPT2LMHeadModel", "gpt", _gpt2_args, _gpt2_config, _gpt2_tensors),
}
# jddp model name: the Architecture whose tensor names it has (every Llama family's alike).
BY_MODEL = {"llama": ARCHITECTURES["llama"], "gpt": ARCHITECTURES["gpt2"]}


def for_export(name: str, model, preferred: str | None = None) -> Architecture:
    """The Architecture jddp model `name` (built as `model`) is written as: for a Llama the
    family that holds its fields (`preferred`, the checkpoint's own, when it does)."""
    if name == "llama":
        return ARCHITECTURES[family_of(model, preferred)]
    return BY_MODEL[name]


def architecture(hf_config: dict, where: str) -> Architecture:
    """The Architecture of a config.json's `model_type`."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"{where} has model_type={model_type!r}; jddp reads "
            f"{', '.join(sorted(ARCHITECTURES))} checkpoints"
        )
    return ARCHITECTURES[model_type]


def model_args(hf_config: dict, where: str) -> tuple[str, dict]:
    """(jddp model name, its arguments) for a config.json (a dict)."""
    arch = architecture(hf_config, where)
    try:
        return arch.model, arch.model_args(hf_config, where)
    except KeyError as e:
        raise ConfigError(
            f"{where} has no {e.args[0]!r}; is it a {arch.hf_class} config?"
        ) from None
