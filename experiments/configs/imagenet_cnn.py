"""A small CNN on ImageNet 2012 at 64x64 (random-resized crops and flips in training, centre
crops in eval): a check of the ImageNet input pipeline, not a strong model. The archives must be
in --config.data.manual_dir (TFDS's manual download); JPEG decoding wants loader processes."""

import ml_collections

from jddp.run.config import default_config


def get_config():
    config = default_config()
    config.model = "cnn"
    config.model_args = ml_collections.ConfigDict(
        {"channels": (32, 64, 128, 256), "dense_size": 512}
    )
    config.dataset = "imagenet2012"
    config.data.image_size = 64
    config.data.workers = 8  # processes decoding and cropping JPEGs
    config.data.threads = 2
    config.global_batch_size = 256
    config.num_train_steps = 100_000  # 20 epochs of 1.28 M images
    config.learning_rate = 2e-3
    config.warmup_steps = 2_000
    config.weight_decay = 5e-5
    config.log_every = 200
    config.eval_every = 10_000
    return config
