"""The real Fashion-MNIST, prepared offline from Debian's `dataset-fashion-mnist` files: the
`fashion_mnist_cnn` experiment reaches 90% test accuracy, eval counts each test image once, and
compressed gradients (bfloat16, PowerSGD) reach float32's test accuracy at the same steps.

`.ci/run` installs the package where the files are missing (and fails if it cannot); elsewhere
these tests skip and say why, and fail under CI=true.
"""

import json
import os
import sys

import numpy as np
import pytest

from experiments.configs import fashion_mnist_cnn
from jddp import data
from jddp.data.mnist import FashionMnist
from jddp.run.experiment import train_and_evaluate
from tests.helpers import OPTIMIZED_CHILD, optimized_compiles, requires_data
from tests.test_multiprocess import launch

FILES = os.path.join(FashionMnist.DEBIAN_DIR, "train-images-idx3-ubyte.gz")
EVAL_BATCH = 1000  # divides the 10,000 test images and the 8 devices


@pytest.fixture(autouse=True, scope="module")
def debian_files():
    requires_data(FILES, "run `apt-get install dataset-fashion-mnist` (.ci/run does)")


@pytest.fixture(scope="module")
def fashion_mnist():
    """Prepared once into the test data dir (a lock keeps parallel workers from both doing it)."""
    return data.open_dataset(data.get_dataset("fashion_mnist"))


def test_prepared_with_tfds_official_metadata(fashion_mnist):
    assert (len(fashion_mnist.train), len(fashion_mnist.eval)) == (60_000, 10_000)
    labels = fashion_mnist.eval.read_batch(np.arange(10_000))["label"]
    assert np.bincount(labels).tolist() == [1000] * 10  # the official test split is balanced


def test_eval_counts_each_test_image_once(fashion_mnist):
    """384 does not divide 10,000: the last batch is padded and masked."""
    labels = []
    for batch in data.eval_batches(fashion_mnist.eval, fashion_mnist.transform, batch_size=384):
        assert batch["image"].shape == (384, 28, 28, 1)
        labels.append(batch["label"][batch["mask"] == 1])
    expected = fashion_mnist.eval.read_batch(np.arange(10_000))["label"]
    np.testing.assert_array_equal(np.concatenate(labels), expected)


def test_fashion_mnist_cnn_reaches_90_percent(fashion_mnist, tmp_path, optimized):
    config = fashion_mnist_cnn.get_config()
    # The config as shipped, 700 steps of 128 (1.5 epochs): 0.909 here on 8 simulated devices
    # (600 steps gave 0.904, too thin a margin). Checkpoints are not what this test checks; the
    # test set is counted in 10 batches rather than 79 (the same count of correct answers).
    config.checkpoint_every, config.eval_batch_size = 0, EVAL_BATCH
    summary = train_and_evaluate(config, str(tmp_path / "run"))
    assert summary["eval_accuracy"] >= 0.90


# Compressed gradients against float32, at the same steps. A shortened run (100 steps of 700,
# 0.86 accuracy; about 20 s each here) keeps CI small; the full runs are in experiments/bench/
# compression_accuracy.py and the README's "Communication" section.
SHORT_STEPS = 100
BFLOAT16 = {"grad_comm_dtype": "bfloat16"}
# PowerSGD as PyTorch advises: uncompressed for the first ~10% of the steps.
POWERSGD = {"grad_compression": "powersgd", "powersgd_rank": 4, "powersgd_start_step": 10}


def short_config(**parallel):
    config = fashion_mnist_cnn.get_config()
    config.num_train_steps = config.eval_every = SHORT_STEPS
    config.warmup_steps, config.log_every, config.checkpoint_every = 10, 50, 0
    config.peak_flops_per_device = 1e12  # MFU's denominator: no matmul timed at each start
    config.eval_batch_size = EVAL_BATCH
    config.parallel.update(parallel)
    return config


def short_run_flags(workdir, **parallel) -> list[str]:
    """`short_config(**parallel)` as command-line flags."""
    config = short_config(**parallel)
    keys = ["num_train_steps", "eval_every", "warmup_steps", "log_every", "checkpoint_every"]
    keys += ["peak_flops_per_device", "eval_batch_size"]
    flags = [f"--config.{key}={config[key]}" for key in keys]
    flags += [f"--config.parallel.{key}={value}" for key, value in parallel.items()]
    return ["--config=experiments/configs/fashion_mnist_cnn.py", f"--workdir={workdir}", *flags]


@pytest.fixture(scope="module")
def float32_accuracy(fashion_mnist, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("float32") / "run"
    with optimized_compiles():
        return train_and_evaluate(short_config(), str(workdir))["eval_accuracy"]


def test_powersgd_reaches_float32_accuracy_on_8_devices(float32_accuracy, tmp_path, optimized):
    """bfloat16's accuracy is the 2-process run's below: across processes its gradients cross
    as one flat buffer, which tests/test_compression.py shows gives the numbers the per-tensor
    collectives give inside one process (and both within their bound of float32's mean)."""
    summary = train_and_evaluate(short_config(**POWERSGD), str(tmp_path / "run"))
    assert summary["eval_accuracy"] >= float32_accuracy - 0.005, float32_accuracy


def test_bfloat16_gradients_reach_float32_accuracy_on_2_processes(float32_accuracy, tmp_path):
    """bfloat16 across 2 processes x 2 devices (gloo between them) against the float32 run,
    which is the same on any device count (tests/test_multiprocess.py): the 8-device one above.
    Measured here: 0.8585 against float32's 0.8589 (PowerSGD on 8 devices: 0.8574)."""
    workdir = tmp_path / "bfloat16"
    command = [sys.executable, "-m", "experiments.train", *short_run_flags(workdir, **BFLOAT16)]
    code, output = launch(2, 2, *command, env=OPTIMIZED_CHILD)  # 100 steps: run time dominates
    assert code == 0, output
    accuracy = json.loads((workdir / "summary.json").read_text())["eval_accuracy"]
    assert accuracy >= float32_accuracy - 0.003, (accuracy, float32_accuracy)
