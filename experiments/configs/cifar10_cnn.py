"""A CNN on CIFAR-10 with the standard augmentation (random crop of the 4-pixel zero-padded
image, random flip), per-channel standardization. TFDS downloads the official binary archive, or
reads cifar-10-binary.tar.gz from --config.data.manual_dir."""

import ml_collections

from jddp.run.config import default_config


def get_config():
    config = default_config()
    config.model = "cnn"
    config.model_args = ml_collections.ConfigDict({"channels": (32, 64, 128), "dense_size": 256})
    config.dataset = "cifar10"
    config.data.augment = True
    config.global_batch_size = 128
    config.num_train_steps = 20_000  # 51 epochs
    config.learning_rate = 2e-3
    config.warmup_steps = 500
    config.weight_decay = 5e-4
    config.log_every = 100
    config.eval_every = 2_000
    return config
