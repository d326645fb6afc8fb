"""The default experiment: an MLP on the UCI digits that scikit-learn ships (no download)."""

from jddp.run.config import default_config


def get_config():
    config = default_config()
    config.model = "mlp"
    config.model_args.hidden_sizes = (256, 256)
    config.dataset = "digits"
    config.global_batch_size = 128
    config.num_train_steps = 600
    config.learning_rate = 2e-3
    config.warmup_steps = 30
    config.weight_decay = 1e-4
    config.log_every = 50
    config.eval_every = 200
    return config
