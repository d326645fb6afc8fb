"""A 1.0B-parameter GPT: 18 layers of width 2048, 16 heads, rotary positions, 2048 tokens.

gpt_124m's optimizer at a lower peak rate; activation checkpointing on (each block's activations
are recomputed in the backward pass). The 50,304-token vocabulary fits any token dataset.
"""

from experiments.configs import gpt_124m


def get_config():
    config = gpt_124m.get_config()
    config.model_args.update(
        num_layers=18,
        num_heads=16,
        embed_dim=2048,
        max_seq_len=2048,
        positions="rotary",
        remat=True,
    )
    config.data.seq_len = 2048
    config.global_batch_size = 256
    config.num_train_steps = 20000
    config.learning_rate = 3e-4
    config.warmup_steps = 1000
    config.eval_every = 1000
    return config
