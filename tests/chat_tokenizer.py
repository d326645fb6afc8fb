"""Tiny byte-level BPE tokenizers of chat models, built with the `tokenizers` library and saved
as transformers saves a fast tokenizer (tokenizer.json + tokenizer_config.json with its chat
template): one in Llama 3's style, one in Qwen 2.5's (ChatML)."""

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "Write a haiku about the sea. Waves fold into foam, salt wind over grey water.",
    "You are a helpful assistant. Answer briefly and exactly.",
    "Translate 'good morning' to German: Guten Morgen. Ça va? Très bien, merci.",
]
# Meta-Llama-3-8B-Instruct's template, as its tokenizer_config.json has it.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5-Instruct's, without its tool calls; `generation` marks the assistant's part (a template
# with {% generation %} markers), or nothing (Qwen's own).
_CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}GENERATION{{- message.content + '<|im_end|>\n' }}END"
    "{%- elif message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role != 'system' %}"
    "{{- raise_exception('Unknown role: ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
CHATML_TEMPLATE = _CHATML.replace("GENERATION", "").replace("END", "")
CHATML_MARKED_TEMPLATE = _CHATML.replace("GENERATION", "{% generation %}").replace(
    "END", "{% endgeneration %}"
)
LLAMA3 = {
    "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"],
    "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "template": LLAMA3_TEMPLATE,
}  # fmt: skip
CHATML = {
    "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "config": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
    "template": CHATML_TEMPLATE,
}


def save_chat_tokenizer(folder, style: dict, template=None, vocab_size: int = 384) -> str:
    """A byte-level BPE tokenizer of CORPUS with `style`'s special tokens, saved in `folder`
    with a tokenizer_config.json holding its tokens and chat template (`template` overrides the
    style's; "" leaves it out); returns the folder."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=style["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **style["config"]}
    template = style["template"] if template is None else template
    if template:
        config["chat_template"] = template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)
