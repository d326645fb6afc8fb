"""How jddp's decoders and Hugging Face's causal language models name and lay out the same
weights: `config.json` <-> a jddp model's arguments, and each jddp parameter <-> one tensor of
`model.safetensors`, with the transform between them.

Llama (`LlamaForCausalLM`, model_type "llama"), Qwen2 / Qwen2.5 ("qwen2": biases on q, k and v),
Qwen3 ("qwen3": RMSNorm on each head's queries and keys) and Mistral ("mistral": a sliding window)
are jddp's `llama` with those fields on; an export is written as the family that holds the model's
fields (jddp/checkpoints/hf_families.py). GPT-2 (`GPT2LMHeadModel`, model_type "gpt2") is jddp's
`gpt` with learned positions and tied embeddings. Hugging Face's `nn.Linear` weights are (out, in)
and jddp's kernels (in, out): those are transposed. GPT-2's `Conv1D` weights are already (in,
out); its fused `c_attn` holds all query columns, then all keys, then all values, where jddp's
`qkv` holds each head's q, k, v together (`QKV_BY_HEAD`).
"""

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from jddp.checkpoints.hf_families import family_of
from jddp.errors import ConfigError
from jddp.models import rotary

TRANSPOSE, QKV_BY_HEAD = "transpose", "qkv_by_head"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One jddp parameter (its per-layer path) and the Hugging Face tensor it comes from."""

    path: str  # "block_0/attn/q/kernel"
    name: str  # "model.layers.0.self_attn.q_proj.weight"
    transform: str = ""  # "", TRANSPOSE, or QKV_BY_HEAD
    heads: int = 0  # QKV_BY_HEAD: the number of heads

    def to_jddp(self, hf: np.ndarray) -> np.ndarray:
        if self.transform == TRANSPOSE:
            return hf.T
        if self.transform == QKV_BY_HEAD:  # [...][part, head, dim] -> [...][head, part, dim]
            lead = hf.shape[:-1]
            split = hf.reshape(*lead, 3, self.heads, -1)
            return np.swapaxes(split, -3, -2).reshape(*lead, -1)
        return hf

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        if self.transform == TRANSPOSE:
            return ours.T
        if self.transform == QKV_BY_HEAD:
            lead = ours.shape[:-1]
            split = ours.reshape(*lead, self.heads, 3, -1)
            return np.swapaxes(split, -3, -2).reshape(*lead, -1)
        return ours

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for a jddp parameter of `shape`."""
        return tuple(reversed(shape)) if self.transform == TRANSPOSE else tuple(shape)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A Hugging Face model family jddp reads and writes."""

    model_type: str  # config.json's "model_type"
    hf_class: str  # config.json's "architectures"
    model: str  # jddp's model name
    model_args: Callable[[dict], dict]  # config.json -> jddp model arguments
    hf_config: Callable[[object], dict]  # jddp model -> config.json
    tensors: Callable[[object], list[Tensor]]  # jddp model -> its parameters' tensors


def _require(hf: dict, where: str, **expected) -> None:
    """A ConfigError for a config.json setting jddp's model does not have."""
    for key, allowed in expected.items():
        value = hf.get(key, allowed[0])
        if value not in allowed:
            raise ConfigError(
                f"{where} has {key}={value!r}, which jddp's model does not implement "
                f"(it supports {' or '.join(map(repr, allowed))})"
            )


def _count(hf: dict, key: str, where: str, default: int | None = None) -> int:
    """config.json's `key`, a positive integer (a dimension or a count); `default` where it is
    absent or null."""
    if key not in hf and default is None:
        raise ConfigError(f"{where} has no {key!r}; is it a save_pretrained config.json?")
    value = hf.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} has {key}={value!r}; expected a positive integer")
    return value


# ------------------------------------------------------------------- Llama, Qwen2, Qwen3, Mistral
# One jddp model, `llama`, whose few orthogonal fields cover the four families; their tensors are
# named alike (`_llama_tensors`).
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
    _require(read, where, rope_type=ROPE_TYPES, partial_rotary_factor=(1.0,))
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
    layers = _count(hf, "num_hidden_layers", where)
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
    return _count(hf, "sliding_window", where) if sliding == {True} else 0


def _llama_args(hf: dict, where: str) -> dict:
    """The arguments every family shares, Llama's biases, and no window (transformers' Llama
    reads none)."""
    _require(hf, where, hidden_act=("silu",))
    heads, width = _count(hf, "num_attention_heads", where), _count(hf, "hidden_size", where)
    args = {
        "vocab_size": _count(hf, "vocab_size", where),
        "num_layers": _count(hf, "num_hidden_layers", where),
        "num_heads": heads,
        "num_kv_heads": _count(hf, "num_key_value_heads", where, heads),
        "embed_dim": width,
        "mlp_dim": _count(hf, "intermediate_size", where),
        "max_seq_len": _count(hf, "max_position_embeddings", where, 2048),
        **_rope(hf, where),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": bool(hf.get("attention_bias", False)),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }
    head_dim = _count(hf, "head_dim", where, width // heads)
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
    window = _count(hf, "sliding_window", where) if hf["sliding_window"] is not None else 0
    args = _llama_args(hf, where) | {"attention_bias": False, "mlp_bias": False}
    return args | {"sliding_window": window}


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
    own = {
        "llama": {"attention_bias": model.attention_bias, "mlp_bias": model.mlp_bias},
        "qwen2": qwen_window,
        "qwen3": {"attention_bias": model.attention_bias} | qwen_window,
        "mistral": {"sliding_window": window},
    }
    return common | own[model_type]


def _llama_tensors(model) -> list[Tensor]:
    found = [Tensor("token_embed/embedding", "model.embed_tokens.weight")]
    linears = {"attn": ("q", "k", "v", "out"), "mlp": ("gate", "up", "proj")}
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
    found.append(Tensor("ln_f/scale", "model.norm.weight"))
    if not model.tie_embeddings:
        found.append(Tensor("head/kernel", "lm_head.weight", TRANSPOSE))
    return found


# ------------------------------------------------------------------------------------ GPT-2
def _gpt2_args(hf: dict, where: str) -> dict:
    _require(
        hf,
        where,
        activation_function=("gelu_new", "gelu_pytorch_tanh"),
        scale_attn_weights=(True,),
        scale_attn_by_inverse_layer_idx=(False,),
        tie_word_embeddings=(True,),
    )
    width = _count(hf, "n_embd", where)
    return {
        "vocab_size": _count(hf, "vocab_size", where),
        "num_layers": _count(hf, "n_layer", where),
        "num_heads": _count(hf, "n_head", where),
        "embed_dim": width,
        "mlp_dim": _count(hf, "n_inner", where, 4 * width),
        "max_seq_len": _count(hf, "n_positions", where),
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
