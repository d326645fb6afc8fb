"""Fine-tune a Llama-family Hugging Face checkpoint on a text file, with the checkpoint's tokenizer.

The paths are yours: the defaults are a checkpoint in ./llama (what `hf download NAME --local-dir
llama` writes: config.json, safetensors, tokenizer.json) and a text file ./data.txt. Point them
elsewhere with

    --config.init_from=hf:DIR --config.data.tokenizer=DIR --config.data.text_file=FILE

(the tokenizer is its own key: set both when the checkpoint moves). The model's shape comes from
DIR/config.json: `model_args` holds only what config.json does not say (remat, dropout); setting
a size there that config.json contradicts is refused in one line. The recipe is Alpaca's
(learning rate 2e-5, 3% warmup, cosine) with global-norm clipping, ZeRO-3 over every device and
bfloat16 compute on float32 master weights. docs/huggingface.md walks through it.
"""

import ml_collections

from jddp.run.config import default_config


def get_config():
    config = default_config()
    config.model = "llama"
    config.init_from = "hf:llama"  # a save_pretrained directory; jddp downloads nothing
    config.model_args = ml_collections.ConfigDict(
        {
            "remat": True,  # recompute each block's activations: memory for long sequences
            "dropout_rate": 0.0,
        }
    )
    config.dataset = "text_file"
    config.data.text_file = "data.txt"
    config.data.tokenizer = "llama"  # the checkpoint's tokenizer.json (a directory holding it)
    config.data.seq_len = 1024  # at most the checkpoint's max_position_embeddings
    config.global_batch_size = 32
    config.num_train_steps = 1000
    config.learning_rate = 2e-5
    config.warmup_steps = 30
    config.min_lr_ratio = 0.1
    config.adam_b2 = 0.95
    config.weight_decay = 0.0
    config.grad_clip_norm = 1.0
    config.compute_dtype = "bfloat16"
    config.parallel.strategy = "zero3"  # parameters, gradients and Adam sharded over fsdp:-1
    config.log_every = 10
    config.eval_every = 200
    config.checkpoint_every = 200
    config.max_to_keep = 2
    return config
