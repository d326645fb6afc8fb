"""GPT-2 small's shape and cost (124M parameters): 12 layers of width 768, 1024 positions.

The vocabulary is GPT-2's 50,257 tokens padded to 50,304 (a multiple of 64, faster matmuls): it
trains on any token dataset whose vocabulary fits, shakespeare_char here until a tokenized web
corpus is added.
"""

import ml_collections

from jddp.run.config import default_config


def get_config():
    config = default_config()
    config.model = "gpt"
    config.model_args = ml_collections.ConfigDict(
        {
            "vocab_size": 50304,
            "num_layers": 12,
            "num_heads": 12,
            "embed_dim": 768,
            "max_seq_len": 1024,
            "positions": "learned",
            "tie_embeddings": True,
            "dropout_rate": 0.0,
            "remat": False,
        }
    )
    config.dataset = "shakespeare_char"
    config.data.seq_len = 1024
    config.global_batch_size = 512
    config.num_train_steps = 5000
    config.learning_rate = 6e-4
    config.warmup_steps = 200
    config.min_lr_ratio = 0.1
    config.adam_b2 = 0.95
    config.weight_decay = 0.1
    config.grad_clip_norm = 1.0
    config.compute_dtype = "bfloat16"
    config.log_every = 10
    config.eval_every = 500
    return config
