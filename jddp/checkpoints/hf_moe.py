"""Mixtral ("mixtral"), Qwen2-MoE ("qwen2_moe") and Qwen3-MoE ("qwen3_moe"): the mixture of
experts in their config.json <-> a jddp Llama's `moe` (jddp/models/moe_settings.py), and their
routers' and experts' tensors (the rest of the model is their dense family's:
jddp/checkpoints/hf_models.py).

All three route as jddp's "softmax_topk": a softmax over every expert, then the top k, whose
weights Mixtral always renormalizes to sum to 1 and Qwen where `norm_topk_prob`;
`router_aux_loss_coef` is the load-balancing loss's weight. Qwen2-MoE adds a shared expert
scaled by a sigmoid gate. Tensors per layer i and expert e (kernels transposed):

- Mixtral: `model.layers.i.block_sparse_moe.gate` -> `block_i/mlp/router`,
  `...experts.e.w1 / w3 / w2` -> `block_i/mlp/experts/gate / up / down` [e];
- Qwen: `model.layers.i.mlp.gate` -> `block_i/mlp/router`, `mlp.experts.e.{gate,up,down}_proj`
  -> `block_i/mlp/experts/{gate,up,down}` [e], `mlp.shared_expert.{gate,up,down}_proj` ->
  `block_i/mlp/shared_expert/{gate,up,proj}/kernel`, `mlp.shared_expert_gate` ->
  `block_i/mlp/shared_expert_gate`.

Each expert has tensors of its own on disk, as the published checkpoints hold them and as
transformers 5's save_pretrained writes them (it fuses them into 3-D `gate_up_proj` /
`down_proj` in memory only).
"""

import dataclasses

from jddp.checkpoints.hf_mapping import TRANSPOSE, Tensor, count, require
from jddp.errors import ConfigError
from jddp.models.moe_settings import MoESettings

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def settings(hf: dict, where: str, model_type: str) -> dict:
    """`model_args.moe` for an MoE family's config.json, every field set; a ConfigError for
    what jddp's mixture of experts lacks (dense MLP layers among the sparse ones, router
    jitter)."""
    mixtral = model_type == "mixtral"
    # Qwen's own name; Mixtral's, and transformers 5 writes it for Qwen3-MoE too
    experts = "num_experts" if "num_experts" in hf else "num_local_experts"
    if mixtral:
        require(hf, where, router_jitter_noise=(0.0,))
    else:
        step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise ConfigError(
                f"{where} has dense MLP layers among its experts' (decoder_sparse_step={step}, "
                f"mlp_only_layers={dense}); jddp puts the experts in every layer: it reads "
                "checkpoints with decoder_sparse_step 1 and no mlp_only_layers"
            )
    moe = {
        "num_experts": count(hf, experts, where),
        "experts_per_token": count(hf, "num_experts_per_tok", where),
        "router_order": "softmax_topk",
        "normalize_top_k": mixtral or bool(hf.get("norm_topk_prob", False)),
        "expert_dim": 0 if mixtral else count(hf, "moe_intermediate_size", where),
        "load_balance_weight": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    if model_type == "qwen2_moe":  # its shared expert, always gated
        shared = count(hf, "shared_expert_intermediate_size", where)
        moe |= {"shared_expert_dim": shared, "shared_expert_gate": True}
    return dataclasses.asdict(MoESettings(**moe))


def config(model, model_type: str) -> dict:
    """The MoE fields of config.json for jddp's Llama `model` (with `moe`) as `model_type`."""
    moe = model.moe
    width = moe.expert_dim or model.hidden_dim
    common = {
        "num_experts_per_tok": moe.experts_per_token,
        "router_aux_loss_coef": moe.load_balance_weight,
    }
    if model_type == "mixtral":
        experts = {"num_local_experts": moe.num_experts, "router_jitter_noise": 0.0}
        return common | experts | {"intermediate_size": width}
    qwen = {
        "num_experts": moe.num_experts,
        "moe_intermediate_size": width,
        "norm_topk_prob": moe.normalize_top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if model_type == "qwen2_moe":
        qwen["shared_expert_intermediate_size"] = moe.shared_expert_dim
    return common | qwen


def tensors(model, model_type: str, ours: str, theirs: str) -> list[Tensor]:
    """The MLP tensors of one layer (jddp's `ours`, "block_0"; Hugging Face's `theirs`,
    "model.layers.0") of jddp's Llama `model` (with `moe`) as `model_type`."""
    moe = model.moe
    if model_type == "mixtral":
        prefix, names = f"{theirs}.block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}
    else:
        prefix = f"{theirs}.mlp"
        names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    found = [Tensor(f"{ours}/mlp/router", f"{prefix}.gate.weight", TRANSPOSE)]
    for name, hf_name in names.items():
        hf_expert = f"{prefix}.experts.{{e}}.{hf_name}.weight"  # "{e}": Tensor.parts
        found.append(Tensor(f"{ours}/mlp/experts/{name}", hf_expert, TRANSPOSE, 0, moe.num_experts))
    if moe.shared_expert_dim:
        for name, hf_name in (("gate", "gate_proj"), ("up", "up_proj"), ("proj", "down_proj")):
            hf_shared = f"{prefix}.shared_expert.{hf_name}.weight"
            found.append(Tensor(f"{ours}/mlp/shared_expert/{name}/kernel", hf_shared, TRANSPOSE))
        if moe.shared_expert_gate:
            hf_gate = f"{prefix}.shared_expert_gate.weight"
            found.append(Tensor(f"{ours}/mlp/shared_expert_gate", hf_gate, TRANSPOSE))
    return found
