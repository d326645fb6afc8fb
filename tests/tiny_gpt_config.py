"""The tiny GPT's experiment config on a text file, for runs through the experiment path. Free of
JAX calls at import, so a config file handed to a multi-process CLI run can import it before
`jax.distributed` starts."""

from experiments.configs import shakespeare_gpt_tiny


def gpt_config(text_file, workdir_of_start="", **parallel):
    config = shakespeare_gpt_tiny.get_config()
    config.dataset, config.data.text_file, config.data.seq_len = "text_file", text_file, 16
    config.model_args.update(num_layers=1, embed_dim=32, max_seq_len=16, vocab_size=128)
    config.global_batch_size, config.num_train_steps, config.warmup_steps = 16, 4, 0
    config.log_every = config.eval_every = config.checkpoint_every = 4
    config.parallel.update(parallel)
    if workdir_of_start:  # a step too small to move a parameter: export = what was loaded
        config.init_from, config.learning_rate, config.num_train_steps = workdir_of_start, 1e-30, 1
    return config
