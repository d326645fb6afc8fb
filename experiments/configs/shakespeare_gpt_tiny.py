"""A tiny character-level GPT on Shakespeare: 4 layers of width 128, minutes on a laptop CPU."""

import ml_collections

from jddp.run.config import default_config


def get_config():
    config = default_config()
    config.model = "gpt"
    config.model_args = ml_collections.ConfigDict(
        {
            "num_layers": 4,
            "num_heads": 4,
            "embed_dim": 128,
            "max_seq_len": 128,
            "positions": "learned",
            "tie_embeddings": True,
            "dropout_rate": 0.0,
            "remat": False,
        }
    )
    config.dataset = "shakespeare_char"
    config.data.seq_len = 128  # examples: {"inputs", "targets"} of 128 characters
    config.global_batch_size = 32
    config.num_train_steps = 2000
    config.learning_rate = 2e-3
    config.warmup_steps = 100
    config.min_lr_ratio = 0.1
    config.adam_b2 = 0.99
    config.weight_decay = 0.1
    config.grad_clip_norm = 1.0
    config.log_every = 100
    config.eval_every = 500
    return config
