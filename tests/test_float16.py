"""float16 compute with dynamic loss scaling (the Flax ImageNet example's `half_precision` on GPUs
without bfloat16): a step whose scaled gradients overflow on any one device is skipped on every
device, decided on the averaged gradients, and the scale halved; good steps raise it again; the
scale is part of the state a checkpoint keeps; and float16 training learns what float32 does."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jddp
from tests.helpers import save_and_restore
from tests.reference import assert_replicas_identical, make_batches, per_example_ce


class ReluNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(5)(nn.relu(nn.Dense(24)(x.reshape(x.shape[0], -1))))


def float16_trainer(strategy, optimizer, **scaling):
    return jddp.Trainer(
        ReluNet(),
        per_example_ce,
        optimizer,
        strategy=strategy,
        compute_dtype="float16",
        loss_scaling=jddp.DynamicLossScale(**scaling),
    )


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_an_overflow_on_one_device_skips_the_step_everywhere_and_lowers_the_scale(strategy):
    trainer = float16_trainer(strategy, optax.adam(1e-2), initial_scale=2.0**10, growth_interval=2)
    batches = make_batches()[:4]
    state = trainer.init(seed=0, sample_batch=batches[0])
    before = trainer.host_state(state)
    overflowing = {**batches[0], "image": batches[0]["image"].copy()}
    # Device 3's rows (of 8 devices): a finite loss, but gradients x 2^10 overflow float16 there.
    overflowing["image"][12:16] *= 1000
    state, metrics = trainer.step(state, overflowing)
    after = trainer.host_state(state)
    assert not np.isfinite(float(metrics["grad_norm"]))
    jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
    jax.tree.map(np.testing.assert_array_equal, after.opt_state, before.opt_state)
    assert float(after.loss_scale["scale"]) == 2.0**9
    assert int(after.nonfinite_steps) == 0  # the scale's overflow, not the model's
    if strategy == "ddp":
        assert_replicas_identical(state)
    # Good steps: the parameters move; after growth_interval of them in a row the scale doubles.
    scales = []
    for batch in batches[1:]:
        state, metrics = trainer.step(state, batch)
        scales.append(float(metrics["loss_scale"]))
    assert scales == [2.0**9, 2.0**9, 2.0**10]
    moved = trainer.host_state(state).params["Dense_0"]["kernel"]
    assert not np.array_equal(moved, before.params["Dense_0"]["kernel"])


def test_float16_learns_as_float32_does_and_its_scale_is_checkpointed(tmp_path):
    # SGD, not Adam: Adam would hide gradients left scaled (it divides by their size).
    batches, optimizer = make_batches()[:1] * 20, optax.sgd(0.1, momentum=0.9)  # learnable
    float32 = jddp.Trainer(ReluNet(), per_example_ce, optimizer, strategy="zero2")
    float16 = float16_trainer("zero2", optimizer, initial_scale=2.0**8, growth_interval=7)
    results = {}
    for name, trainer in (("float32", float32), ("float16", float16)):
        state = trainer.init(seed=0, sample_batch=batches[0])
        losses = []
        for batch in batches:
            state, metrics = trainer.step(state, batch)
            losses.append(float(metrics["loss"]))
        results[name] = losses
    assert results["float16"][-1] < 0.7 * results["float16"][0]  # it learns
    np.testing.assert_allclose(results["float16"], results["float32"], rtol=2e-2)
    host = float16.host_state(state)
    assert int(host.nonfinite_steps) == 0
    # 20 good steps, growth every 7: 2^8 -> 2^10, and 6 good steps towards the next.
    assert (float(host.loss_scale["scale"]), int(host.loss_scale["good_steps"])) == (2.0**10, 6)
    _, restored, _ = save_and_restore(float16, state, float16, batches[0], str(tmp_path))
    restored = float16.host_state(restored)
    assert (float(restored.loss_scale["scale"]), int(restored.loss_scale["good_steps"])) == (
        2.0**10,
        6,
    )


def test_loss_scaling_options_are_checked():
    with pytest.raises(jddp.ConfigError, match="backoff_factor must be finite and in"):
        jddp.DynamicLossScale(backoff_factor=1.5)
    with pytest.raises(jddp.ConfigError, match="growth_interval must be a positive integer"):
        jddp.DynamicLossScale(growth_interval=0)
