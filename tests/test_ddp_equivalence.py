"""DDP on 1, 2, 4 and 8 devices trains exactly what one device trains on the same global batches.

The reference is a plain single-device `jax.jit` + optax loop written here, sharing nothing with
jddp but the model, the optimizer and the initial parameters.
"""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jddp
from tests.reference import assert_trees_close

GLOBAL_BATCH = 32
STEPS = 20


class SmallNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(24)(x.reshape(x.shape[0], -1)))
        return nn.Dense(5)(x)


def per_example_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def make_batches(seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.normal(size=(GLOBAL_BATCH, 4, 3)).astype(np.float32),
            "label": rng.integers(0, 5, size=(GLOBAL_BATCH,)).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


def reference_training(params, optimizer, batches):
    """Single device: mean cross-entropy over the whole global batch, one optax update per batch."""
    model = SmallNet()

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return jax.device_get(params), losses


CLIP_NORM = 0.5


def optimizer_for(clip: bool):
    adam = optax.adam(3e-3)
    return optax.chain(optax.clip_by_global_norm(CLIP_NORM), adam) if clip else adam


CASES = [(n, accum, False) for n in (1, 2, 4, 8) for accum in (1, 2, 4)]
CASES += [(n, 2, True) for n in (1, 2, 4, 8)]


@pytest.mark.parametrize("num_devices,accum,clip", CASES)
def test_ddp_matches_single_device_reference(num_devices, accum, clip):
    optimizer = optimizer_for(clip)
    batches = make_batches()
    trainer = jddp.Trainer(
        SmallNet(),
        per_example_ce,
        optimizer,
        devices=jax.devices()[:num_devices],
        grad_accum_steps=accum,
    )
    state = trainer.init(seed=0, sample_batch=batches[0])
    initial_params = trainer.host_state(state).params

    losses, grad_norms = [], []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))

    expected_params, expected_losses = reference_training(initial_params, optimizer, batches)
    assert_trees_close(trainer.host_state(state).params, expected_params)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert int(trainer.host_state(state).step) == STEPS
    if clip:  # the clip must have bitten, or this case would prove nothing about clipping
        assert max(grad_norms) > CLIP_NORM


def test_replicas_stay_identical():
    batches = make_batches(seed=1)
    trainer = jddp.Trainer(SmallNet(), per_example_ce, optimizer_for(clip=True), grad_accum_steps=2)
    assert trainer.num_devices == 8
    state = trainer.init(seed=3, sample_batch=batches[0])
    for batch in batches:
        state, _ = trainer.step(state, batch)
    for leaf in jax.tree.leaves(state):
        replicas = [np.asarray(shard.data) for shard in leaf.addressable_shards]
        assert len(replicas) == 8
        for replica in replicas[1:]:
            np.testing.assert_array_equal(replica, replicas[0])


def test_initialization_depends_only_on_the_seed():
    batch = make_batches()[0]

    def initial_params(num_devices, seed):
        trainer = jddp.Trainer(
            SmallNet(), per_example_ce, optax.sgd(0.1), devices=jax.devices()[:num_devices]
        )
        return trainer.host_state(trainer.init(seed=seed, sample_batch=batch)).params

    jax.tree.map(np.testing.assert_array_equal, initial_params(1, 7), initial_params(8, 7))
    different = jax.tree.map(np.array_equal, initial_params(1, 7), initial_params(1, 8))
    assert not all(jax.tree.leaves(different))  # kernels differ (biases start at zero)
