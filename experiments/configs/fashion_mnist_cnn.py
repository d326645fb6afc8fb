"""A small CNN on Fashion-MNIST (60,000 train / 10,000 test 28x28 clothes): the one to try after
the default. Offline, TFDS prepares it from Debian's `dataset-fashion-mnist` package."""

import ml_collections

from jddp.run.config import default_config


def get_config():
    config = default_config()
    config.model = "cnn"
    config.model_args = ml_collections.ConfigDict({"channels": (16, 32), "dense_size": 128})
    config.dataset = "fashion_mnist"
    config.global_batch_size = 128
    config.num_train_steps = 700  # 1.5 epochs
    config.learning_rate = 5e-3
    config.warmup_steps = 30
    config.weight_decay = 1e-4
    config.log_every = 100
    config.eval_every = 700
    return config
