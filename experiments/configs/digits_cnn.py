"""A small CNN on the UCI digits: the default experiment's data, schedule and cadence."""

import ml_collections

from experiments.configs import digits_mlp


def get_config():
    config = digits_mlp.get_config()
    config.model = "cnn"
    config.model_args = ml_collections.ConfigDict({"channels": (32, 64), "dense_size": 128})
    return config
