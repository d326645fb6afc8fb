"""Losses that see the parameters, and weights: an L2 penalty of the kernels added to the loss (the
Flax ImageNet example's) and per-example weights whose mean over the whole global batch,
sum(w * l) / sum(w), is exact at 1, 2 and 8 devices, under every ZeRO stage and with gradient
accumulation, in training and in eval, against the plain single-device reference. The weights are
uneven on purpose: whole devices' and micro-batches' slices weigh nothing, where a mean of
per-device means would be wrong (or NaN)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from tests.helpers import train_from
from tests.reference import SmallNet, assert_trees_close, per_example_ce, plain_training

GLOBAL_BATCH, STEPS, WEIGHT_DECAY = 32, 3, 1e-2
OPTIMIZER = optax.sgd(0.3, momentum=0.9)


def l2_penalty(params):
    """The Flax ImageNet example's: weight_decay / 2 x the squares of every kernel (ndim > 1)."""
    return WEIGHT_DECAY * 0.5 * sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)


def weighted_batches():
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(STEPS):
        weight = rng.uniform(0.1, 3.0, size=GLOBAL_BATCH).astype(np.float32)
        weight[4:16] = 0.0  # several devices' slices, and micro-batches, weigh nothing
        batches.append(
            {
                "image": rng.normal(size=(GLOBAL_BATCH, 4, 3)).astype(np.float32),
                "label": rng.integers(0, 5, size=GLOBAL_BATCH).astype(np.int32),
                "weight": weight,
            }
        )
    return batches


@jax.jit
def weighted_ce(params, batch):
    losses = per_example_ce(SmallNet().apply({"params": params}, batch["image"]), batch)
    return jnp.sum(losses * batch["weight"]) / jnp.sum(batch["weight"])


@functools.cache
def reference_run():
    """(initial parameters, final parameters, loss + penalty per step) of the plain loop on one
    device, from the test's own initialization: shared by every case."""
    data = weighted_batches()
    initial = SmallNet().init(jax.random.key(1), data[0]["image"][:1])["params"]

    def reference_loss(params, model_state, batch):
        return weighted_ce(params, batch) + l2_penalty(params), model_state

    params, _, totals = plain_training(reference_loss, initial, {}, OPTIMIZER, data)
    return jax.device_get(initial), params, totals


@pytest.mark.parametrize(
    "strategy,devices,grad_accum_steps",
    [
        ("ddp", 1, 2),
        ("ddp", 8, 2),
        ("zero1", 8, 1),
        ("zero2", 2, 2),
        ("zero3", 8, 2),
    ],
)
def test_weighted_mean_and_regularizer_match_one_device(strategy, devices, grad_accum_steps):
    data = weighted_batches()
    initial, params, totals = reference_run()
    trainer = jddp.Trainer(
        SmallNet(),
        per_example_ce,
        OPTIMIZER,
        strategy=strategy,
        devices=jax.devices()[:devices],
        grad_accum_steps=grad_accum_steps,
        regularizer=l2_penalty,
        weight_key="weight",
    )
    state, history = train_from(trainer, initial, data)
    final = trainer.host_state(state).params
    assert_trees_close(final, params)
    np.testing.assert_allclose([m["loss"] + m["regularizer"] for m in history], totals, rtol=1e-5)
    assert history[0]["regularizer"] > 0.01 * history[0]["loss"]  # a real part of the loss

    # Eval: the weighted mean over every example of ragged batches, the penalty left out.
    ragged = [data[0], {k: v[:13] for k, v in data[1].items()}]
    whole = {k: np.concatenate([b[k] for b in ragged]) for k in ragged[0]}
    result = trainer.evaluate(state, ragged)
    np.testing.assert_allclose(result["loss"], float(weighted_ce(final, whole)), rtol=1e-5)
    assert result["count"] == GLOBAL_BATCH + 13
