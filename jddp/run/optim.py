"""The optax optimizer an experiment config describes: warmup + cosine, weight decay, clipping."""

import jax
import optax

from jddp.core.layer_stacks import STACKED
from jddp.errors import ConfigError

OPTIMIZERS = ("adamw", "sgd")


def learning_rate_schedule(config) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate` over `warmup_steps`, then cosine decay to
    `learning_rate * min_lr_ratio` at `num_train_steps`."""
    if config.warmup_steps < 0 or config.warmup_steps >= config.num_train_steps:
        raise ConfigError(
            f"warmup_steps={config.warmup_steps} must be in [0, num_train_steps="
            f"{config.num_train_steps}); lower --config.warmup_steps"
        )
    if config.warmup_steps == 0:  # (optax logs a warning for a zero-length warmup)
        return optax.cosine_decay_schedule(
            config.learning_rate, config.num_train_steps, alpha=config.min_lr_ratio
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=config.num_train_steps,
        end_value=config.learning_rate * config.min_lr_ratio,
    )


def _decay_matrices_only(params):
    # Weight decay on kernels, not on biases or normalization scales (the usual AdamW practice);
    # stacked layers (blocks/..., a leading layer axis) by the shape of one layer, so that a
    # stacked bias is not taken for a matrix.
    def is_matrix(path, x):
        stacked = any(getattr(entry, "key", None) == STACKED for entry in path)
        return x.ndim - stacked > 1

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def create_optimizer(config, schedule: optax.Schedule) -> optax.GradientTransformation:
    """`config.optimizer` with `schedule`, after global-norm clipping when `grad_clip_norm` > 0."""
    if config.optimizer == "adamw":
        base = optax.adamw(
            schedule,
            b1=config.adam_b1,
            b2=config.adam_b2,
            weight_decay=config.weight_decay,
            mask=_decay_matrices_only,
        )
    elif config.optimizer == "sgd":
        base = optax.chain(
            optax.add_decayed_weights(config.weight_decay, mask=_decay_matrices_only),
            optax.sgd(schedule, momentum=config.momentum or None),
        )
    else:
        raise ConfigError(
            f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"
        )
    if config.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), base)
    return base
