"""Hugging Face checkpoints in and out: a `save_pretrained` directory of a Llama-family (Mixtral's
and Qwen-MoE's mixtures of experts too) or GPT-2 causal language model starts a jddp run under
any strategy and mesh, and a run's weights go back out as one that
`transformers.AutoModelForCausalLM.from_pretrained` loads as it is.

    model = jddp.checkpoints.hf.create_model("llama-dir")          # its config.json's model
    trainer = jddp.Trainer(model, loss_fn, optax.adamw(1e-4), strategy="zero3")
    state = jddp.checkpoints.hf.load(trainer, trainer.init(0, batch), "llama-dir")
    ...
    jddp.checkpoints.hf.save(trainer.host_state(state).params, model, "out")  # or: jddp-export

From a config: `init_from = "hf:DIR"` (the model's arguments come from DIR/config.json), and the
command `jddp-export --format=hf WORKDIR OUT` (jddp/run/export.py).
"""

import dataclasses
import os

import jax
import numpy as np

from jddp.checkpoints import hf_files, hf_models
from jddp.core import layer_stacks, lora
from jddp.core.state import arranged_like
from jddp.core.tree_paths import nest_paths, path_str
from jddp.errors import CheckpointError, ConfigError
from jddp.models.moe_settings import MoESettings

PREFIX = "hf:"


def is_hf(init_from: str) -> bool:
    return isinstance(init_from, str) and init_from.startswith(PREFIX)


def directory(init_from: str) -> str:
    """DIR of "hf:DIR"."""
    return os.path.expanduser(init_from[len(PREFIX) :])


def model_args(path: str, what: str = "init_from hf:") -> tuple[str, dict]:
    """(jddp model name, its arguments) that DIR/config.json describes."""
    return hf_models.model_args(hf_files.read_config(path, what), f"{path}/config.json")


def resolved_model_args(model: str, given: dict, init_from: str) -> dict:
    """A config's model arguments: `given`, and with `init_from="hf:DIR"` every argument
    DIR/config.json sets. A ConfigError names a model or an argument that contradicts it."""
    if not is_hf(init_from):
        return dict(given)
    path = directory(init_from)
    name, from_file = model_args(path, f"init_from {init_from!r}:")
    if model != name:
        raise ConfigError(
            f"init_from {init_from!r} holds a {name} model and the config trains model "
            f"{model!r}; set model={name!r}"
        )
    given, from_file = _flat_moe(given), _flat_moe(from_file)
    for key in MOE_TRAINING:  # the config's choice over the checkpoint's
        if key in given:
            from_file.pop(key, None)
    clashes = [k for k in sorted(given.keys() & from_file.keys()) if given[k] != from_file[k]]
    if clashes:
        shown = ", ".join(f"{k}={given[k]!r} (config.json: {from_file[k]!r})" for k in clashes)
        raise ConfigError(
            f"model_args {shown} contradict {path}/config.json; remove them from model_args "
            "(the checkpoint sets them)"
        )
    args = {**given, **from_file}
    moe = {k.removeprefix(MOE): args.pop(k) for k in sorted(args) if k.startswith(MOE)}
    return args | ({"moe": moe} if moe else {})


# A mixture of experts' settings a config may choose over a checkpoint's (how tokens are
# dispatched, the auxiliary losses' weights); the others are the checkpoint's architecture.
MOE = "moe."
MOE_TRAINING = tuple(
    MOE + k for k in ("dispatch", "capacity_factor", "load_balance_weight", "z_loss_weight")
)


def _flat_moe(args) -> dict:
    """`args` with its `moe` as "moe.FIELD" entries; a checkpoint's has every field."""
    args = dict(args)
    moe = args.pop("moe", None)
    if isinstance(moe, MoESettings):
        moe = dataclasses.asdict(moe)
    return args | {MOE + k: v for k, v in dict(moe or {}).items()}


def create_model(path: str, **overrides):
    """The jddp model (GPT or Llama) a save_pretrained directory holds; `overrides` set the
    arguments config.json does not (dropout_rate, remat, scan_layers, ...)."""
    from jddp import models

    name, args = model_args(path, "Hugging Face checkpoint")
    return models.MODELS[name](**resolved_model_args(name, overrides, PREFIX + path))


def _model_name(model) -> str:
    from jddp import models

    for name in hf_models.BY_MODEL:
        if type(model) is models.MODELS[name]:
            return name
    raise ConfigError(
        f"{type(model).__name__} has no Hugging Face layout; jddp converts its gpt and llama models"
    )


def _architecture(model, preferred: str | None = None) -> hf_models.Architecture:
    """The Hugging Face architecture `model` is written as (`hf_models.for_export`)."""
    return hf_models.for_export(_model_name(model), model, preferred)


def _tensors(model) -> list[hf_models.Tensor]:
    return hf_models.BY_MODEL[_model_name(model)].tensors(model)


def check(path: str, model, params) -> None:
    """A CheckpointError (one line, reading headers only) unless DIR holds every tensor of
    `model` in the shapes of `params` (arrays or shapes, per-layer or stacked)."""
    with hf_files.Reader(path, "init_from hf:") as reader:
        lazy_params(reader, model, lora.split(params)[0])


def load(trainer, state, path: str):
    """`state` with its parameters read from the save_pretrained directory `path` (the
    optimizer state, step and RNG stay; so do LoRA adapters, which the checkpoint has not).
    `state` may be abstract (`trainer.abstract_state`)."""
    if state.layer_order is not None:  # its tensors are in the model's layer order
        state = trainer.global_state(state)
    base, adapters = lora.split(state.params)
    with hf_files.Reader(path, "Hugging Face checkpoint") as reader:
        lazy = lazy_params(reader, trainer.task.model, base)
        lazy = arranged_like(base, lazy, path)
        base = jax.tree.map(_place, base, lazy)
    return state.replace(params=lora.joined(base, adapters))


def _place(like, lazy) -> jax.Array:
    """`lazy` read and placed device by device in `like`'s sharding: each device's shard is
    read alone and copied before the next is read, so the host holds one shard at a time
    beyond the placed ones (`jax.make_array_from_callback` reads every local device's shard
    first, a whole tensor on a host with many devices)."""
    shards = []
    for device, index in like.sharding.addressable_devices_indices_map(like.shape).items():
        shards.append(jax.device_put(lazy[index], device).block_until_ready())
    return jax.make_array_from_single_device_arrays(like.shape, like.sharding, shards)


def lazy_params(reader: hf_files.Reader, model, params):
    """A tree of `params`' structure (per-layer or stacked) whose leaves read their values from
    `reader` when indexed; a CheckpointError first (headers only) if a tensor is missing or of
    another shape."""
    shapes = _shapes(params)
    stacked = layer_stacks.is_stacked(shapes)
    per_layer = layer_stacks.per_layer_shapes(shapes) if stacked else shapes
    tensors = _tensors(model)
    reader.check(tensors, per_layer)
    dtype = jax.tree.leaves(params)[0].dtype
    tree = nest_paths({t.path: reader.lazy(t, per_layer[t.path], dtype) for t in tensors})
    return layer_stacks.to_stacked(tree) if stacked else tree


def _shapes(tree) -> dict[str, tuple]:
    return {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def hf_tensors(params, model) -> dict[str, np.ndarray]:
    """`params` (any layout; device or host arrays) as Hugging Face tensors by name."""
    per_layer = layer_stacks.to_per_layer(jax.tree.map(np.asarray, params))
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(per_layer)}
    tensors = _tensors(model)
    unmapped = sorted(flat.keys() - {t.path for t in tensors})
    if unmapped:
        raise CheckpointError(
            f"parameter {unmapped[0]!r} has no place in a Hugging Face {type(model).__name__}"
        )
    found = {}
    for tensor in tensors:
        ours = flat[tensor.path]
        parts = tensor.parts()  # one per expert: the stack's slices
        found |= {p.name: p.to_hf(ours[e] if tensor.experts else ours) for e, p in enumerate(parts)}
    return found


def check_output(out: str) -> None:
    """A CheckpointError unless `out` is new or an empty directory (nothing is overwritten),
    with no `OUT.partial` that is not this export's (`hf_files.check_partial`)."""
    if os.path.isdir(out) and os.listdir(out):
        raise CheckpointError(f"{out} is not empty; pass a new directory (nothing was written)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointError(f"{out} is a file; pass a new directory (nothing was written)")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):  # created by the export: the first that exists decides
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise CheckpointError(f"{parent} is not a writable directory; pass another OUT")
    hf_files.check_partial(out)


def save(
    params,
    model,
    out: str,
    max_shard_bytes: int = hf_files.DEFAULT_MAX_SHARD_BYTES,
    *,
    like: str | None = None,
    tokenizer: str | None = None,
    dtype: str = "float32",
) -> list[str]:
    """Writes `params` of the jddp `model` to `out` as save_pretrained would: config.json and
    safetensors in `dtype` (float32, bfloat16 or float16; sharded above `max_shard_bytes`, with
    the index). `params` may be in any layout; in a job of several processes pass host arrays
    (`trainer.host_state(state).params`). `like`: the save_pretrained
    directory the weights came from, whose special token ids and generation_config.json go
    along; `tokenizer`: a tokenizer.json (or its directory), copied with its tokenizer_config.json,
    special_tokens_map.json and chat_template.jinja. Returns the files copied."""
    check_output(out)
    as_dtype = export_dtype(dtype)
    source = {}
    if like and os.path.isfile(os.path.join(like, hf_files.CONFIG)):
        source = hf_files.read_config(like, "the original checkpoint")
    config = _architecture(model, source.get("model_type")).hf_config(model) | {"dtype": dtype}
    config |= {k: source[k] for k in _SPECIAL_TOKEN_IDS if source.get(k) is not None}
    companions = _existing(like, "generation_config.json") if source else []
    if tokenizer:
        folder = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)
        companions += [tokenizer] if os.path.isfile(tokenizer) else []
        names = (
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja",  # where recent transformers saves a chat template
        )  # fmt: skip
        companions += [f for f in _existing(folder, *names) if f not in companions]
    tensors = {k: v.astype(as_dtype, copy=False) for k, v in hf_tensors(params, model).items()}
    hf_files.write(out, config, tensors, max_shard_bytes, tuple(companions))
    return companions


_SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def export_dtype(dtype: str):
    """The array dtype an export writes, named by `dtype` (one of EXPORT_DTYPES; numpy's own
    dtypes lack bfloat16); a ConfigError names another."""
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    return jax.numpy.dtype(dtype)


def _existing(folder: str, *names: str) -> list[str]:
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
