"""A run's LoRA adapters alone, as PEFT saves them: `adapter_config.json` and
`adapter_model.safetensors` with PEFT's tensor names
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), which
`peft.PeftModel.from_pretrained(base_model, OUT)` loads onto the Hugging Face base model.

jddp's adapters of a projection are `lora_A` (in, rank) and `lora_B` (rank, out) beside its
kernel (jddp/core/lora.py); PEFT's are `nn.Linear` weights, (rank, in) and (out, rank):
transposed, like the kernels themselves (jddp/checkpoints/hf_models.py).
"""

import jax
import numpy as np

from jddp.checkpoints import hf, hf_files, hf_models
from jddp.core import layer_stacks
from jddp.core.lora import LoRA, is_adapter
from jddp.core.tree_paths import path_str
from jddp.errors import CheckpointError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's wrapper around the causal LM


def adapter_tensors(params, model) -> dict[str, np.ndarray]:
    """The adapters in `params` (any layout; device or host arrays) by PEFT's names."""
    per_layer = layer_stacks.to_per_layer(jax.tree.map(np.asarray, params))
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(per_layer)}
    kernels = {t.path: t for t in hf._tensors(model)}
    found = {}
    for path, value in flat.items():
        if not is_adapter(path):
            continue
        module, which = path.rsplit("/", 1)
        tensor = kernels.get(f"{module}/kernel")
        if tensor is None or tensor.transform != hf_models.TRANSPOSE:
            raise CheckpointError(
                f"the adapter {path!r} sits on no nn.Linear of a Hugging Face "
                f"{type(model).__name__}, so PEFT has no name for it; export --format=hf "
                "(merged weights) instead"
            )
        found[f"{PREFIX}{tensor.name.removesuffix('.weight')}.{which}.weight"] = value.T
    if not found:
        raise CheckpointError("the parameters hold no LoRA adapters; export --format=hf instead")
    return dict(sorted(found.items()))


def adapter_config(lora: LoRA, modules: list[str], base_model: str = "") -> dict:
    """PEFT's `LoraConfig` for adapters on exactly `modules` (Hugging Face module names)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        # A regex PEFT full-matches against module names: these modules and no others.
        "target_modules": "|".join(m.replace(".", r"\.") for m in modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
    }


def save(
    params, model, lora: LoRA, out: str, *, base_model: str = "", dtype: str = "float32"
) -> None:
    """Writes the adapters of `params` (the jddp `model`'s, trained with `lora`) to `out` in
    PEFT's format, as `dtype` (one of `hf.EXPORT_DTYPES`); `base_model` is recorded as
    `base_model_name_or_path`. Nothing is written unless every adapter has a PEFT name and `out`
    is new or empty."""
    hf.check_output(out)
    as_dtype = hf.export_dtype(dtype)
    tensors = {k: v.astype(as_dtype) for k, v in adapter_tensors(params, model).items()}
    modules = sorted({name[len(PREFIX) :].rsplit(".", 2)[0] for name in tensors})
    config = adapter_config(lora, modules, base_model)
    hf_files.write(out, config, tensors, max_shard_bytes=2**63, files=(CONFIG, WEIGHTS))
