"""ResNet-50 (v1.5) on ImageNet-1k: the 90-epoch SGD recipe of Goyal et al. at batch 1024."""

import ml_collections

from jddp.run.config import default_config

STEPS_PER_EPOCH = 1251  # 1,281,167 training images / 1024


def get_config():
    config = default_config()
    config.model = "resnet"
    config.model_args = ml_collections.ConfigDict(
        {"depth": 50, "stem": "imagenet", "width": 64, "remat": False}
    )
    config.dataset = "imagenet2012"
    config.global_batch_size = 1024
    config.num_train_steps = 90 * STEPS_PER_EPOCH
    config.optimizer = "sgd"
    config.momentum = 0.9
    config.learning_rate = 0.4  # 0.1 per 256 examples
    config.warmup_steps = 5 * STEPS_PER_EPOCH
    config.weight_decay = 1e-4
    config.compute_dtype = "bfloat16"
    config.log_every = 100
    config.eval_every = 5 * STEPS_PER_EPOCH
    return config
