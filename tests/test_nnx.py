"""Flax NNX modules go through the same core as Linen ones: an NNX network with BatchNorm trains
under every strategy exactly as its Linen twin trains on one device; dropout and eval mode work
the NNX way."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from tests.reference import assert_trees_close, batchnorm_classifier_loss, plain_training

GLOBAL_BATCH = 32
STEPS = 5


class NnxNet(nnx.Module):
    def __init__(self, *, axis_name=None, rngs: nnx.Rngs):
        # No bias before BatchNorm: its gradient is zero, and a tensor of rounding noise
        # cannot be compared with a relative tolerance.
        self.dense = nnx.Linear(6, 16, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.9, axis_name=axis_name, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.dense(x))))


class NnxDropoutNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(6, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(nnx.relu(self.dense(x))))


class LinenNet(nn.Module):
    """NnxNet in Linen, with the same parameter and statistics names."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(not train, momentum=0.9, epsilon=1e-5, name="bn")(
            nn.Dense(16, use_bias=False, name="dense")(x)
        )
        return nn.Dense(3, name="head")(nn.relu(x))


def batches(seed=0, steps=STEPS):
    rng = np.random.default_rng(seed)
    return [
        {
            "image": (rng.normal(size=(GLOBAL_BATCH, 6)) * 2 + 1).astype(np.float32),
            "label": rng.integers(0, 3, size=GLOBAL_BATCH).astype(np.int32),
        }
        for _ in range(steps)
    ]


# zero3: parameters sharded; hybrid: BatchNorm reduces over a two-axis mesh.
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "hybrid"])
def test_nnx_module_trains_like_its_linen_twin_on_one_device(strategy):
    data = batches()
    optimizer = optax.sgd(0.1, momentum=0.9)
    model = NnxNet(axis_name=jddp.batch_axis_name(strategy), rngs=nnx.Rngs(0))
    trainer = jddp.Trainer(model, jddp.losses.softmax_cross_entropy, optimizer, strategy=strategy)
    state = trainer.init(seed=0, sample_batch=data[0])
    initial = trainer.host_state(state)
    assert set(initial.params) == {"dense", "bn", "head"}  # plain dicts, NNX's attribute names
    assert set(initial.model_state["batch_stats"]["bn"]) == {"mean", "var"}
    for batch in data:
        state, _ = trainer.step(state, batch)

    twin = LinenNet()
    params, model_state, _ = plain_training(
        batchnorm_classifier_loss(twin), initial.params, initial.model_state, optimizer, data
    )
    host = trainer.host_state(state)
    assert_trees_close(host.params, params)
    assert_trees_close(host.model_state, model_state)

    # Evaluation runs the NNX module in eval mode: BatchNorm uses the running statistics.
    held_out = batches(seed=1, steps=1)[0]
    logits = twin.apply({"params": params, **model_state}, held_out["image"], train=False)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, held_out["label"]).mean()
    assert trainer.evaluate(state, [held_out])["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_nnx_dropout_draws_a_new_mask_each_step_and_is_off_in_eval():
    batch = batches(seed=2, steps=1)[0]
    model = NnxDropoutNet(rngs=nnx.Rngs(0))
    trainer = jddp.Trainer(
        model, jddp.losses.softmax_cross_entropy, optax.sgd(0.0), devices=jax.devices()[:2]
    )

    def losses(seed):
        state = trainer.init(seed=seed, sample_batch=batch)
        out = []
        for _ in range(3):  # parameters never move: only the masks change the loss
            state, metrics = trainer.step(state, batch)
            out.append(float(metrics["loss"]))
        return state, out

    state, first = losses(seed=0)
    assert len(set(first)) == 3
    assert losses(seed=0)[1] == first  # deterministic per (seed, step)

    model.eval()  # reference: the user's own module, in eval mode, called directly
    logits = model(batch["image"])
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    assert trainer.evaluate(state, [batch])["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_something_that_is_not_a_flax_module_is_a_config_error():
    with pytest.raises(jddp.ConfigError, match="must be a flax.linen.Module or a flax.nnx.Module"):
        jddp.Trainer(lambda x: x, jddp.losses.softmax_cross_entropy, optax.sgd(0.1))
