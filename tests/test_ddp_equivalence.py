"""DDP on 1, 2, 4 and 8 devices trains exactly what one device trains on the same global batches.

The reference is a plain single-device `jax.jit` + optax loop (tests/reference.py), sharing
nothing with jddp but the model, the optimizer and the initial parameters.
"""

import jax
import numpy as np
import optax
import pytest

import jddp
from tests.reference import (
    CLIP_NORM,
    SmallNet,
    assert_replicas_identical,
    make_batches,
    optimizer_for,
    per_example_ce,
    train_and_compare,
)

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
    grad_norms = train_and_compare(trainer, optimizer, batches)
    if clip:  # the clip must have bitten, or this case would prove nothing about clipping
        assert max(grad_norms) > CLIP_NORM


def test_replicas_stay_identical():
    batches = make_batches(seed=1)
    trainer = jddp.Trainer(SmallNet(), per_example_ce, optimizer_for(clip=True), grad_accum_steps=2)
    assert trainer.num_devices == 8
    state = trainer.init(seed=3, sample_batch=batches[0])
    for batch in batches:
        state, _ = trainer.step(state, batch)
    assert all(len(leaf.addressable_shards) == 8 for leaf in jax.tree.leaves(state))
    assert_replicas_identical(state)


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
