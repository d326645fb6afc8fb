"""Chat fine-tuning (SFT) of a Llama-family Hugging Face checkpoint on your conversations, the loss
on the assistant's tokens only: `llama_finetune`'s recipe on instruction data.

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
evaluation. A full fine-tune, as `llama_finetune`: every weight trains, sharded with its Adam
moments over every device (ZeRO-3), bfloat16 compute on float32 master weights, remat, learning
rate 2e-5 with warmup and a cosine decay, clipping at 1.0.
"""

from experiments.configs import llama_finetune


def get_config():
    config = llama_finetune.get_config()
    config.dataset = "jsonl:chat.jsonl"
    config.data.text_file = ""
    config.data.tokenizer = "llama"  # the checkpoint's tokenizer and chat template
    config.data.loss_on = "completion"  # the assistant's turns (all: every token)
    config.data.eval_fraction = 0.05  # held-out conversations
    config.data.seq_len = 2048  # at most the checkpoint's max_position_embeddings
    return config
