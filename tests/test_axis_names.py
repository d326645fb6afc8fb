"""Models written for pmap, with `axis_name="batch"` in their BatchNorm (as the Flax ImageNet
example's ResNet is), train unchanged under every strategy's mesh with statistics over the whole
global batch; an axis name no strategy has is a one-line error."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from tests.reference import assert_trees_close, batchnorm_classifier_loss, plain_training

GLOBAL_BATCH, STEPS = 32, 4


class PmapEraNet(nn.Module):
    """Written the way pmap-era Flax models are: the BatchNorm names the pmap axis "batch"."""

    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16, use_bias=False, name="dense")(x)
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=self.axis_name if train else None,
            name="bn",
        )(x)
        return nn.Dense(3, name="head")(nn.relu(x))


class NnxPmapEraNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(6, 16, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.9, axis_name="batch", rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.dense(x))))


def batches():
    rng = np.random.default_rng(0)
    return [
        {
            # Means far from 0: statistics over 4 rows per device would differ a lot.
            "image": (rng.normal(size=(GLOBAL_BATCH, 6)) * 2 + 1).astype(np.float32),
            "label": rng.integers(0, 3, size=GLOBAL_BATCH).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


@pytest.mark.parametrize(
    "kind,strategy,mesh",
    [
        ("linen", "ddp", None),
        ("linen", "zero1", None),
        ("linen", "zero2", None),
        ("linen", "zero3", None),
        ("linen", "hybrid", "data:2,fsdp:4"),
        ("nnx", "zero3", None),
        ("nnx", "hybrid", "data:2,fsdp:4"),
    ],
)
def test_batch_axis_name_binds_to_every_strategys_batch_axes(kind, strategy, mesh):
    data = batches()
    optimizer = optax.sgd(0.1, momentum=0.9)
    model = PmapEraNet() if kind == "linen" else NnxPmapEraNet(nnx.Rngs(0))
    trainer = jddp.Trainer(
        model, jddp.losses.softmax_cross_entropy, optimizer, strategy=strategy, mesh=mesh
    )
    state = trainer.init(seed=0, sample_batch=data[0])
    initial = trainer.host_state(state)
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    # One device, BatchNorm over the whole global batch, no axis at all.
    params, model_state, expected = plain_training(
        batchnorm_classifier_loss(PmapEraNet(axis_name=None)),
        initial.params,
        initial.model_state,
        optimizer,
        data,
    )
    host = trainer.host_state(state)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(host.params, params)
    assert_trees_close(host.model_state, model_state)
    if kind == "nnx":
        assert model.bn.axis_name == "batch"  # the user's own module is left as it was


def test_an_axis_name_no_strategy_has_is_a_one_line_error():
    trainer = jddp.Trainer(
        PmapEraNet(axis_name="devices"),
        jddp.losses.softmax_cross_entropy,
        optax.sgd(0.1),
        strategy="zero3",
    )
    with pytest.raises(jddp.ConfigError) as info:
        state = trainer.init(seed=0, sample_batch=batches()[0])
        trainer.step(state, batches()[0])
    message = str(info.value)
    assert "'devices'" in message and "axis_name='batch'" in message and "\n" not in message
    assert jax.device_count() == 8
