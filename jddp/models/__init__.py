"""Flax models by the name a config's `model` gives them: a built-in one, or your own as
"package.module:Name" (jddp/models/user_models.py)."""

import dataclasses
import difflib

import flax.linen as nn

from jddp.errors import ConfigError
from jddp.models import llama
from jddp.models.cnn import CNN
from jddp.models.decoder import Decoder, check_tensor_split
from jddp.models.gpt import GPT, TENSOR_PARALLEL_RULES
from jddp.models.llama import Llama
from jddp.models.mlp import MLP
from jddp.models.resnet import ResNet
from jddp.models.user_models import check_outputs, is_import_path
from jddp.models.user_models import create as create_user_model
from jddp.parallel import context

MODELS: dict[str, type[nn.Module]] = {
    "mlp": MLP,
    "cnn": CNN,
    "resnet": ResNet,
    "gpt": GPT,
    "llama": Llama,
}
# The field that receives the dataset's number of outputs (classes, or the vocabulary size).
OUTPUT_FIELDS = {"gpt": "vocab_size", "llama": "vocab_size"}
# Models with a tensor-parallel preset (`tensor_rules`).
TENSOR_PARALLEL_MODELS = ("gpt", "llama")


def tensor_rules(name: str, model: nn.Module, tensor: int) -> tuple:
    """The partition rules for model `name` (built as `model`) on a mesh whose tensor axis has
    `tensor` devices: GPT's and Llama's Megatron layouts; () for other models."""
    if name == "gpt":
        return TENSOR_PARALLEL_RULES
    if name == "llama":
        return llama.tensor_parallel_rules(model.kv_heads, tensor)
    return ()


# Fields jddp sets from the mesh, never from model_args.
_MESH_FIELDS = {
    "parent",
    "name",
    "batch_axis_name",
    "tensor_axis",
    "sequence_parallel",
    "context_axis",
    "context_attention",
    "expert_axis",
}


def create_model(
    name: str,
    num_outputs: int,
    /,  # a model may take a `num_outputs` (or `name`) argument itself, through model_args
    *,
    batch_axis_name: str | tuple[str, ...] | None = None,
    tensor_axis: str | None = None,
    tensor_size: int = 1,
    sequence_parallel: bool = False,
    context_axis: str | None = None,
    context_attention: str = "ring",
    expert_axis: str | None = None,
    pipelined: bool = False,
    seed: int = 0,
    **model_args,
):
    """The model `name` with `num_outputs` outputs; `model_args` are its other fields.

    `model_args` may ask for more outputs than the dataset has (a vocabulary padded to a multiple
    of 64, say), never fewer. The mesh gives the rest: `batch_axis_name` to models with
    BatchNorm (ResNet), `tensor_axis` (of size `tensor_size`), `sequence_parallel`,
    `context_axis`, `context_attention` (ring | all_gather) and `expert_axis` to GPT and
    Llama; `pipelined` (a
    mesh with a stage axis) stacks their layers (`scan_layers`). An
    own model ("package.module:Name") gets the same fields where it declares them, its outputs as
    `num_outputs`, and an NNX one `rngs=nnx.Rngs(seed)`.
    """
    _check_sequence_parallel(sequence_parallel, tensor_axis)
    context.check_implementation(context_attention)
    mesh_fields = {
        "batch_axis_name": batch_axis_name,
        "tensor_axis": tensor_axis,
        "sequence_parallel": sequence_parallel,
        "context_axis": context_axis,
        "context_attention": context_attention,
        "expert_axis": expert_axis,
    }
    if is_import_path(name):
        model = create_user_model(
            name,
            num_outputs,
            seed=seed,
            mesh_fields=mesh_fields,
            pipelined=pipelined,
            model_args=model_args,
        )
        if context_axis:
            context.check_model(model, context_axis)
        return model
    if name not in MODELS:
        close = difflib.get_close_matches(name, MODELS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown model {name!r}{hint}; choose one of {', '.join(sorted(MODELS))}, or your "
            "own as 'package.module:Name'"
        )
    cls = MODELS[name]
    output_field = OUTPUT_FIELDS.get(name, "num_classes")
    all_fields = {f.name for f in dataclasses.fields(cls)}
    fields = all_fields - _MESH_FIELDS
    unknown = sorted(set(model_args) - fields)
    if unknown:
        raise ConfigError(
            f"model {name!r} has no argument {', '.join(unknown)}; its arguments are "
            f"{', '.join(sorted(fields))} (set them under config.model_args)"
        )
    outputs = check_outputs(model_args.pop(output_field, num_outputs), num_outputs, output_field)
    if sequence_parallel and "sequence_parallel" not in all_fields:
        raise ConfigError(
            f"parallel.sequence_parallel applies to the gpt and llama models, not {name!r}; "
            "set it to false"
        )
    model_args |= {k: v for k, v in mesh_fields.items() if k in all_fields}
    if pipelined and "scan_layers" in all_fields:
        model_args["scan_layers"] = True
    model = cls(**{output_field: outputs}, **model_args)
    if context_axis:
        context.check_model(model, context_axis)
    if tensor_size > 1 and isinstance(model, Decoder):
        check_tensor_split(model, tensor_size)
    return model


def _check_sequence_parallel(sequence_parallel: bool, tensor_axis: str | None) -> None:
    if sequence_parallel and tensor_axis is None:
        raise ConfigError(
            "parallel.sequence_parallel splits the sequence over the tensor axis, and "
            "parallel.mesh has none; add one (e.g. 'fsdp:-1,tensor:2') or set it to false"
        )
