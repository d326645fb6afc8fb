"""Where a run starts: the newest complete checkpoint of its workdir (resume), weights saved
elsewhere (`init_from`), or a fresh initialization from the seed; and the checks, all made before
anything is written, that the start can go ahead."""

import dataclasses
import inspect
import json
import os

import jax
from absl import logging

from jddp import models
from jddp.checkpoints import compatibility, hf, weights
from jddp.checkpoints.newest import NewestCheckpoint
from jddp.core import layer_stacks
from jddp.errors import CheckpointError, ConfigError, DataError, WorkdirError
from jddp.models import user_models
from jddp.run.config import default_config

# Keys a resumed run may change without it counting as a config change: they decide how the run
# is logged, evaluated, checkpointed, profiled, read from disk or placed on devices (checkpoints
# restore into any strategy, as into any device count), not what it trains. Any other difference
# (learning rate, steps, seed, batch size, model, data, dtype, ...) is refused unless
# allow_config_change=true. A key ending in "." covers every key under it.
RESUME_MAY_CHANGE = (
    "log.",
    "log_every",
    "eval_every",
    "eval_batch_size",
    "log_grad_norm",
    "checkpoint_every",
    "max_to_keep",
    "profile_start_step",
    "profile_num_steps",
    "peak_flops_per_device",
    "hang_timeout_s",
    "init_from",  # used only by a fresh start
    "init_from_optimizer",
    "allow_config_change",
    "data.data_dir",
    "data.manual_dir",
    "data.threads",
    "data.workers",
    "data.device_prefetch",
    "data.cache_max_mb",
    "data.eval_path",  # evaluation only: the training rows stay as they were
    "parallel.",
)
_SHOWN_CHANGES = 4  # changed keys spelled out in the refusal; the rest are counted


@dataclasses.dataclass(frozen=True)
class Start:
    """What the checks found: `resume_step` of the workdir's newest checkpoint (None: a fresh
    start), the config changes allowed on resume ({key: [saved, now]}), and whether the saved
    data order continues (else the data restarts at `resume_step` in this config's order)."""

    resume_step: int | None = None
    config_changes: dict = dataclasses.field(default_factory=dict)
    data_order_continues: bool = True


def _resolved(config) -> dict:
    return json.loads(config.to_json_best_effort())


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: dict, config) -> dict[str, list]:
    """{dotted key: [saved value, this config's value]} for every key that differs between a
    checkpoint's config and `config`, except the keys in RESUME_MAY_CHANGE. A model argument
    set on one side only counts at the model's own default on the other (see `model_defaults`):
    setting it to that default is no change."""
    resolved = _resolved(config)
    before, now = _flat(saved), _flat(resolved)
    model, saved_model = resolved.get("model"), saved.get("model")
    # Code is imported only where this config names it: a checkpoint's metadata (which a
    # workdir's files can say anything in) never chooses a module to import.
    trusted = saved_model == model or not user_models.is_import_path(str(saved_model))
    defaults = {
        "before": model_defaults(saved_model) if trusted else {},
        "now": model_defaults(model),
    }

    def may_change(key: str) -> bool:
        return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_MAY_CHANGE)

    lora_defaults = _flat({"lora": default_config().lora.to_dict()})

    def value(side: str, values: dict, key: str):
        if key in values:
            return True, values[key]
        name = key.removeprefix("model_args.")
        if key.startswith("model_args.") and name in defaults[side]:
            return True, defaults[side][name]
        if side == "before" and key.startswith("lora.") and key in lora_defaults:
            return True, lora_defaults[key]  # written before jddp had LoRA: none
        return False, None

    changes = {}
    for key in sorted(before.keys() | now.keys()):
        old, new = value("before", before, key), value("now", now, key)
        if not may_change(key) and old != new:
            changes[key] = [old[1], new[1]]
    return changes


# Shown for a model's output size left unset: the dataset's number of classes (or tokens).
DATASET_OUTPUTS = "unset (the dataset's)"


def model_defaults(model: str | None) -> dict:
    """{argument: default} of the model a config's `model` names (built-in, or an own
    "package.module:Name"), as JSON would hold them; its output size counts as
    DATASET_OUTPUTS (jddp fills it from the dataset). {} where the model cannot be found."""
    if not isinstance(model, str):
        return {}
    own = user_models.is_import_path(model)
    try:
        target = user_models.load(model) if own else models.MODELS.get(model)
    except Exception:  # an own model since moved or broken: compare the values as written
        return {}
    if target is None:
        return {}
    output = user_models.OUTPUT_FIELD if own else models.OUTPUT_FIELDS.get(model, "num_classes")
    found = {
        name: json.loads(json.dumps(value, default=str))
        for name, value in argument_defaults(target).items()
    }
    return found | {output: DATASET_OUTPUTS}


def argument_defaults(target) -> dict:
    """{argument: default value} of a model class or of a function returning a model: a Linen
    module's dataclass fields (less `parent` and `name`), an NNX module's `__init__`
    parameters, a function's parameters. Arguments without a default are left out."""
    if dataclasses.is_dataclass(target):
        found = {}
        for field in dataclasses.fields(target):
            if field.name in ("parent", "name") or not field.init:
                continue
            if field.default is not dataclasses.MISSING:
                found[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                found[field.name] = field.default_factory()
        return found
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a callable Python cannot look into
        return {}
    return {
        name: parameter.default
        for name, parameter in signature.parameters.items()
        if parameter.default is not parameter.empty
    }


def check_before_start(newest: NewestCheckpoint, config, trainer, sample_batch, batches) -> Start:
    """Refuses, before anything is written and from metadata only (`newest`, the workdir's
    newest checkpoint as read once for this start): checkpoints written with another config
    (unless `allow_config_change`) or of another model, a saved data order that does not fit,
    and an `init_from` that is missing or of another model."""
    abstract = trainer.abstract_state(sample_batch)
    directory = newest.directory
    if newest.meta is None:
        if config.init_from:
            _check_init_from(config, abstract, trainer.task.model)
        return Start()
    meta = newest.meta
    changes = check_resumable(meta, newest.saved_shapes(), config, abstract, directory)
    compatibility.check_state_matches(
        abstract, newest.saved_tree, f"the checkpoints in {directory}", "or pass a new --workdir"
    )
    step = newest.step
    if step > config.num_train_steps:
        raise ConfigError(
            f"the checkpoints in {directory} reach step {step}, past num_train_steps="
            f"{config.num_train_steps}; raise --config.num_train_steps or pass a new --workdir"
        )
    misfit = batches.misfit(meta["data"]) if meta.get("data") else []
    if misfit and not config.allow_config_change:
        raise DataError(
            f"the data order saved in {directory} does not fit this run ({', '.join(misfit)}); "
            "resume with the data it was trained on, or pass --config.allow_config_change=true "
            "to continue in this data's order"
        )
    if changes:
        logging.warning("resuming with config changes (allow_config_change): %s", changes)
    return Start(step, changes, not misfit)


def check_resumable(meta, saved_shapes, config, abstract_state, directory) -> dict:
    """The config changes (allowed) of resuming the checkpoint `meta` describes; refuses other
    changes, and gradient compression state of another setting."""
    changes = config_changes(meta.get("config", {}), config)
    if changes and not config.allow_config_change:
        listed = list(changes.items())[:_SHOWN_CHANGES]
        shown = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in listed)
        more = len(changes) - _SHOWN_CHANGES
        workdir = os.path.dirname(directory)
        raise WorkdirError(
            f"the checkpoints in {directory} were written with another config ({shown}"
            f"{f' and {more} more' if more > 0 else ''}); resume with the config it was trained "
            f"with ({os.path.join(workdir, 'config.json')}), pass a new --workdir, or pass "
            "--config.allow_config_change=true to continue with these changes"
        )
    _check_comm_state(meta, saved_shapes, config, abstract_state, directory)
    return changes  # whether the state fits: checked by the store before anything is read


def _check_comm_state(meta, saved_shapes, config, abstract_state, directory) -> None:
    """Refuses a checkpoint whose gradient-communication state (PowerSGD's) is not the one this
    run keeps: its error feedback and factors belong to the compression it was saved with."""
    ours = {
        path: shape
        for path, shape in compatibility.shapes_by_path(abstract_state).items()
        if path.startswith("comm_state/")
    }
    if ours == {p: s for p, s in saved_shapes.items() if p.startswith("comm_state/")}:
        return
    keys = ("grad_compression", "powersgd_rank")
    saved = meta.get("config", {}).get("parallel", {})
    shown = ", ".join(f"{k}={saved.get(k, 'none')!r} -> {config.parallel[k]!r}" for k in keys)
    raise WorkdirError(
        f"the checkpoints in {directory} hold the gradient compression state of another setting "
        f"(parallel.{shown}); resume with the setting they were saved with, or pass a new "
        "--workdir"
    )


def _check_init_from(config, abstract_state, model) -> None:
    if hf.is_hf(config.init_from):
        if config.init_from_optimizer:
            raise ConfigError(
                f"init_from {config.init_from!r} holds weights only (a Hugging Face checkpoint "
                "has no optimizer state); set init_from_optimizer=false"
            )
        hf.check(hf.directory(config.init_from), model, abstract_state.params)
        return
    if not os.path.exists(config.init_from):
        raise CheckpointError(
            f"init_from {config.init_from!r} does not exist; point it at a jddp workdir (or its "
            "checkpoints/STEP or export dir), or at a checkpoint directory written by orbax or "
            "flax.training.checkpoints"
        )
    params, model_state, saved = weights.weight_shapes(config.init_from)
    trees = [(abstract_state.params, params)]
    if model_state is not None and jax.tree.leaves(abstract_state.model_state):
        trees.append((abstract_state.model_state, model_state))
    for tree, shapes in trees:
        mismatch = compatibility.model_mismatch(tree, shapes, f"init_from {saved!r}")
        if mismatch:
            raise CheckpointError(f"{mismatch}; point init_from at weights of the same model")
    if config.init_from_optimizer and weights.jddp_state_in(config.init_from) is None:
        raise CheckpointError(
            f"init_from {config.init_from!r} holds no jddp optimizer state (an export, or another "
            "program's checkpoint, has weights only); set init_from_optimizer=false, or use "
            "Trainer.replace_state(opt_state=...) from the library"
        )


def fresh_state(trainer, config, sample_batch):
    """The state a run without checkpoints starts from: initialized from the seed, then the
    weights of `init_from` if the config names any."""
    state = trainer.init(config.seed, sample_batch)
    if config.init_from:
        state = _init_from(trainer, state, config, sample_batch)
    return state


def _init_from(trainer, state, config, sample_batch):
    """`state` with the weights saved at `config.init_from` (parameters, and batch statistics
    where the checkpoint has them) and with `init_from_optimizer`, the optimizer state; the step,
    RNG and data order stay this run's own."""
    if hf.is_hf(config.init_from):
        logging.info("initialized from the Hugging Face checkpoint %s", config.init_from)
        return hf.load(trainer, state, hf.directory(config.init_from))
    saved = weights.load_weights(config.init_from)
    has_model_state = bool(jax.tree.leaves(state.model_state))
    if has_model_state and saved.model_state is None:
        logging.warning(
            "%s holds no batch statistics: the model's start from their initial values",
            saved.source,
        )
    stacked = layer_stacks.is_stacked(compatibility.shapes_by_path(state.params))
    convert = layer_stacks.to_stacked if stacked else layer_stacks.to_per_layer
    state = trainer.replace_state(
        state,
        params=convert(saved.params),
        model_state=saved.model_state if has_model_state else None,
    )
    if config.init_from_optimizer:
        abstract = trainer.abstract_state(sample_batch)
        target, to_ours = compatibility.restore_layout(
            abstract, weights.state_shapes(config.init_from)
        )
        loaded = weights.load_state(config.init_from, target)
        loaded = to_ours(loaded) if to_ours else loaded
        state = state.replace(opt_state=loaded.opt_state, model_state=loaded.model_state)
    logging.info(
        "initialized from %s%s",
        saved.source,
        " (parameters and optimizer state)" if config.init_from_optimizer else "",
    )
    return state
