"""Chat fine-tuning (SFT) of a Llama-family Hugging Face checkpoint on your conversations, the loss
on the assistant's tokens only.

The paths are yours: the defaults are a chat (instruct) checkpoint in ./llama (what `hf download
NAME --local-dir llama` writes: config.json, safetensors, tokenizer.json and tokenizer_config.json
with the chat template) and ./chat.jsonl, one conversation per line:

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

(or `prompt` / `completion` columns; Parquet and `datasets` directories too:
docs/instruction-data.md). Point them elsewhere with

    --config.init_from=hf:DIR --config.data.tokenizer=DIR --config.dataset=jsonl:FILE

Each conversation is rendered by the tokenizer's chat template (the ids transformers'
`apply_chat_template` gives) and is one example of up to `data.seq_len` + 1 tokens, cut at its end
if longer (the log line counts those); the loss is the mean over the assistant's tokens of the
whole batch (`data.loss_on=all` counts every token). 5% of the conversations are held out for
evaluation. A full fine-tune: every weight trains, sharded with its Adam moments over every device
(ZeRO-3), bfloat16 compute on float32 master weights; TRL's SFT defaults otherwise (learning rate
2e-5, 3% warmup, cosine, clipping at 1.0).
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
    config.dataset = "jsonl:chat.jsonl"
    config.data.tokenizer = "llama"  # the checkpoint's tokenizer and chat template
    config.data.loss_on = "completion"  # the assistant's turns (all: every token)
    config.data.eval_fraction = 0.05  # held-out conversations
    config.data.seq_len = 2048  # at most the checkpoint's max_position_embeddings
    config.global_batch_size = 32
    config.num_train_steps = 1000
    config.learning_rate = 2e-5
    config.warmup_steps = 30
    config.min_lr_ratio = 0.0
    config.adam_b2 = 0.999
    config.weight_decay = 0.0
    config.grad_clip_norm = 1.0
    config.compute_dtype = "bfloat16"
    config.parallel.strategy = "zero3"  # parameters, gradients and Adam sharded over fsdp:-1
    config.log_every = 10
    config.eval_every = 200
    config.checkpoint_every = 200
    config.max_to_keep = 2
    return config
