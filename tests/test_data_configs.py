"""The CIFAR-10 and ImageNet configs work offline from tiny files in the official formats in the
manual dir: dataset, preprocessing, loader workers and model fit together."""

import numpy as np
import optax

from experiments.configs import cifar10_cnn, imagenet_cnn
from jddp import data, losses, models
from jddp.core.task import Task
from jddp.run.experiment import train_and_evaluate
from jddp.run.input_check import check_model_takes_data
from tests import fake_files
from tests.helpers import assert_accuracy_over


def offline(config, tmp_path):
    config.data.data_dir = str(tmp_path / "tfds")
    config.data.manual_dir = str(tmp_path / "manual")
    return config


def test_cifar10_cnn_trains_end_to_end(tmp_path):
    written = fake_files.write_cifar(tmp_path / "manual")
    config = offline(cifar10_cnn.get_config(), tmp_path)
    config.global_batch_size = 16
    config.num_train_steps, config.warmup_steps, config.log_every, config.eval_every = 3, 1, 1, 3
    summary = train_and_evaluate(config, str(tmp_path / "run"))
    assert np.isfinite(summary["eval_loss"])
    assert_accuracy_over(summary["eval_accuracy"], len(written["test_labels"]))


def test_imagenet_cnn_loads_through_worker_processes_and_fits_its_model(tmp_path):
    """Not trained here (a compile of the 64x64 model costs a minute on 2 cores): the model is
    checked against a real example, and batches come through a loader process."""
    fake_files.write_imagenet(tmp_path / "manual")
    config = offline(imagenet_cnn.get_config(), tmp_path)
    spec = data.get_dataset(config.dataset)
    dataset = data.open_dataset(spec, data.DataOptions.from_config(config.data))
    model = models.create_model(config.model, spec.num_classes, **config.model_args)
    task = Task(model, losses.softmax_cross_entropy, optax.sgd(0.1))
    check_model_takes_data(task, dataset.sample_batch(), config.model, config.dataset)
    size = config.data.image_size
    batches = data.train_batches(
        dataset.train, dataset.transform, global_batch_size=8, seed=0, workers=1
    )
    try:
        for _ in range(3):  # 12 training images: crosses an epoch
            batch = next(batches)
            assert batch["image"].shape == (8, size, size, 3) and batch["label"].shape == (8,)
    finally:
        batches.close()
    (last,) = list(data.eval_batches(dataset.eval, dataset.transform, batch_size=16))
    assert last["image"].shape == (16, size, size, 3) and last["mask"].sum() == 10
