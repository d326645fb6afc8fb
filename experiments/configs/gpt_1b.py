"""A 1.0B-parameter GPT: 18 layers of width 2048, 16 heads, rotary positions, 2048 tokens.

Activation checkpointing is on (each block's activations are recomputed in the backward pass).
Like gpt_124m, the 50,304-token vocabulary fits any token dataset; shakespeare_char for now.
"""

import ml_collections

from jddp.config import default_config


def get_config():
    config = default_config()
    config.model = "gpt"
    config.model_args = ml_collections.ConfigDict(
        {
            "vocab_size": 50304,
            "num_layers": 18,
            "num_heads": 16,
            "embed_dim": 2048,
            "max_seq_len": 2048,
            "positions": "rotary",
            "tie_embeddings": True,
            "dropout_rate": 0.0,
            "remat": True,
        }
    )
    config.dataset = "shakespeare_char"
    config.data.seq_len = 2048
    config.global_batch_size = 256
    config.num_train_steps = 20000
    config.learning_rate = 3e-4
    config.warmup_steps = 1000
    config.min_lr_ratio = 0.1
    config.adam_b2 = 0.95
    config.weight_decay = 0.1
    config.grad_clip_norm = 1.0
    config.compute_dtype = "bfloat16"
    config.log_every = 10
    config.eval_every = 1000
    return config
