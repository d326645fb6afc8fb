"""ResNet: synchronized BatchNorm under DDP trains what one device trains on the global batch;
the architectures have the published parameter counts; bad settings are one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.models import ResNet
from tests.helpers import param_count, train_steps
from tests.reference import (
    assert_replicas_identical,
    assert_trees_close,
    batchnorm_classifier_loss,
    computed_once,
    plain_training,
)

GLOBAL_BATCH = 16
STEPS = 4


def image_batches(seed=0, steps=STEPS, size=GLOBAL_BATCH):
    rng = np.random.default_rng(seed)
    return [
        {
            # Channel means far from 0 and unequal scales: statistics matter to the result.
            "image": (rng.normal(size=(size, 8, 8, 3)) * [1.0, 3.0, 0.5] + 2.0).astype(np.float32),
            "label": rng.integers(0, 10, size=size).astype(np.int32),
        }
        for _ in range(steps)
    ]


def tiny_resnet18(**kwargs) -> ResNet:
    return ResNet(num_classes=10, depth=18, stem="cifar", width=4, **kwargs)


def sgd():
    return optax.sgd(0.05, momentum=0.9)


def one_device_reference(params, model_state, batches):
    """(params, model_state, losses) of the plain single-device loop from `params` and
    `model_state` on `batches`: BatchNorm sees the whole global batch by itself."""
    loss_fn = batchnorm_classifier_loss(tiny_resnet18())
    return plain_training(loss_fn, params, model_state, sgd(), batches)


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "auto"])
def test_synchronized_batchnorm_equals_one_device_on_the_global_batch(strategy):
    batches = image_batches()
    optimizer = sgd()
    model = tiny_resnet18(batch_axis_name=jddp.batch_axis_name(strategy))
    trainer = jddp.Trainer(
        model,
        jddp.losses.softmax_cross_entropy,
        optimizer,
        strategy=strategy,
        log_grad_norm=False,
    )
    assert trainer.num_devices == 8  # 2 examples per device: local statistics would differ a lot
    state = trainer.init(seed=0, sample_batch=batches[0])
    initial = trainer.host_state(state)
    state, losses = train_steps(trainer, state, batches)

    # One device (computed once: the strategies start from the same initialization).
    params, model_state, expected_losses = computed_once(
        one_device_reference, initial.params, initial.model_state, batches
    )
    host = trainer.host_state(state)
    # signed: each block's last BatchNorm scale starts at zero, so its entries are sums of
    # updates of both signs, positive by chance (seen 1.9e-5 apart on a 6e-4 entry, AMD EPYC)
    assert_trees_close(host.params, params, signed=True)
    assert_trees_close(host.model_state["batch_stats"], model_state["batch_stats"])
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_replicas_identical(state.model_state)
    # The statistics moved away from their initial (0 mean, 1 variance) values.
    mean = host.model_state["batch_stats"]["stem_bn"]["mean"]
    assert np.max(np.abs(mean)) > 0.05


@pytest.mark.parametrize(
    "depth,stem,classes,expected",
    [
        (18, "imagenet", 1000, 11_689_512),  # torchvision resnet18
        (50, "imagenet", 1000, 25_557_032),  # torchvision resnet50
        (18, "cifar", 10, 11_173_962),  # the usual CIFAR ResNet-18 (3x3 stem, no max-pool)
    ],
)
def test_parameter_counts_match_the_published_models(depth, stem, classes, expected):
    image_size = 224 if stem == "imagenet" else 32
    model = ResNet(classes, depth=depth, stem=stem)
    assert param_count(model, jnp.zeros((1, image_size, image_size, 3)), train=False) == expected


BAD_SETTINGS = [
    (dict(depth=20), jddp.ConfigError, "depth=20 is not one of 18, 34, 50, 101, 152"),
    (dict(stem="tiny"), jddp.ConfigError, "stem='tiny'; choose one of imagenet, cifar"),
    (dict(width=0), jddp.ConfigError, "width=0"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_SETTINGS, ids=lambda x: str(x)[:20])
def test_bad_settings_are_one_line_errors(kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")) as raised:
        ResNet(10, **kwargs)
    assert "\n" not in str(raised.value)


def test_images_without_a_channel_axis_are_a_shape_error():
    expected = r"\(batch, height, width, channels\), got \(2, 8, 8\)"
    with pytest.raises(jddp.ShapeError, match=expected):
        tiny_resnet18().init(jax.random.key(0), jnp.zeros((2, 8, 8)), train=False)
