"""Chat fine-tuning (SFT) of a Llama-family Hugging Face checkpoint with LoRA: `llama_chat_sft`'s
data, tokenizer, template and loss on the assistant's tokens, with the base frozen and low-rank
adapters on every attention and MLP projection training.

The paths are `llama_chat_sft`'s (./llama from `hf download NAME --local-dir llama`, and
./chat.jsonl of `messages`); point them elsewhere with

    --config.init_from=hf:DIR --config.data.tokenizer=DIR --config.dataset=jsonl:FILE

The LoRA settings are the ones TRL's documentation gives for SFT with PEFT (`LoraConfig(r=16,
lora_alpha=32, lora_dropout=0.05)`, all linear layers of the decoder; PEFT's own defaults are r=8,
alpha=8, no dropout), and the learning rate is TRL's for LoRA, 2e-4, about 10x a full
fine-tune's (QLoRA used 2e-4 for 7B and 13B models): the adapters start at zero (B = 0) and have
far fewer weights to move. The base stays sharded over every device (ZeRO-3) with no Adam moments;
`jddp-export --format=peft` writes the adapters alone, `--format=hf` the merged model.
docs/huggingface.md walks through it.
"""

from experiments.configs import llama_chat_sft


def get_config():
    config = llama_chat_sft.get_config()
    config.lora.rank = 16
    config.lora.alpha = 32.0  # the update is scaled by alpha / rank = 2
    config.lora.dropout = 0.05
    # lora.targets stays the default: q, k, v, o and gate, up, down (PEFT's "all-linear" without
    # the head)
    config.learning_rate = 2e-4
    return config
