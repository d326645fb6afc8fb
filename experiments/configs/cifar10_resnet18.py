"""ResNet-18 with the CIFAR stem on CIFAR-10: SGD with momentum, about 40 epochs of 50,000."""

import ml_collections

from jddp.run.config import default_config


def get_config():
    config = default_config()
    config.model = "resnet"
    config.model_args = ml_collections.ConfigDict(
        {"depth": 18, "stem": "cifar", "width": 64, "remat": False}
    )
    config.dataset = "cifar10"
    config.global_batch_size = 512
    config.num_train_steps = 3900  # ~40 epochs at 98 steps each
    config.optimizer = "sgd"
    config.momentum = 0.9
    config.learning_rate = 0.2  # 0.1 per 256 examples
    config.warmup_steps = 200
    config.weight_decay = 5e-4  # kernels only; BatchNorm scales and biases are not decayed
    config.compute_dtype = "bfloat16"
    config.log_every = 100
    config.eval_every = 975
    return config
