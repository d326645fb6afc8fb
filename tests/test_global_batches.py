"""The global batch the devices hold at step s is the same, bit for bit, on 1, 2, 4 or 8 devices,
with 1 or 2 processes, and after a saved input state is restored.

Two processes are simulated inside this one: each gets its own pipeline (`process_index`,
`process_count`) and its own half of the devices, as two hosts would.
"""

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp import data, losses
from jddp.data import transforms
from jddp.models import MLP

N, GLOBAL_BATCH, STEPS = 203, 32, 8  # 8 steps of 32 cross an epoch boundary of 203


def cifar_like():
    rng = np.random.default_rng(0)
    source = data.ArraySource(
        {
            "image": rng.integers(0, 256, (N, 32, 32, 3), np.uint8),
            "label": rng.integers(0, 10, N).astype(np.int32),
        }
    )
    transform = transforms.StandardizeImages(transforms.CIFAR_MEAN, transforms.CIFAR_STD)
    return source, transform


def host_reference():
    """The global batches as one process reads them, never touching a device."""
    source, transform = cifar_like()
    pipeline = data.train_batches(source, transform, global_batch_size=GLOBAL_BATCH, seed=4)
    return [next(pipeline) for _ in range(STEPS)]


def device_pipelines(num_devices, process_count, state=None):
    """Per simulated process: batches placed on its devices by the trainer, double-buffered."""
    source, transform = cifar_like()
    per_process = num_devices // process_count
    pipelines = []
    for p in range(process_count):
        trainer = jddp.Trainer(
            MLP(num_classes=10),
            losses.softmax_cross_entropy,
            optax.sgd(0.1),
            devices=jax.devices()[p * per_process : (p + 1) * per_process],
        )
        batches = data.train_batches(
            source, transform, global_batch_size=GLOBAL_BATCH, seed=4, process_index=p,
            process_count=process_count,
        )  # fmt: skip
        placed = data.prefetch_to_device(batches, trainer.place_batch)
        if state is not None:
            placed.set_state(state)
        pipelines.append(placed)
    return pipelines


def global_batch_from_devices(pipelines):
    """Next batch of every process, read back from its devices and joined in process order."""
    parts = [next(pipeline).arrays for pipeline in pipelines]
    return {
        name: np.concatenate(
            [np.asarray(part[name]).reshape(-1, *part[name].shape[2:]) for part in parts]
        )
        for name in parts[0]
    }


@pytest.mark.parametrize(
    "num_devices,process_count", [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2)]
)
def test_devices_hold_the_same_global_batches(num_devices, process_count):
    reference = host_reference()
    pipelines = device_pipelines(num_devices, process_count)
    for step in range(STEPS):
        batch = global_batch_from_devices(pipelines)
        for name, expected in reference[step].items():
            np.testing.assert_array_equal(batch[name], expected, err_msg=f"{name} at step {step}")


@pytest.mark.parametrize("num_devices,process_count", [(8, 1), (4, 2)])
def test_restored_state_continues_with_the_same_batches(num_devices, process_count):
    reference = host_reference()
    pipelines = device_pipelines(8, 1)
    for _ in range(3):
        global_batch_from_devices(pipelines)
    state = pipelines[0].get_state()  # saved from 8 devices, 1 process; restored as asked
    restored = device_pipelines(num_devices, process_count, state=state)
    for step in range(3, STEPS):
        batch = global_batch_from_devices(restored)
        for name, expected in reference[step].items():
            np.testing.assert_array_equal(batch[name], expected)
