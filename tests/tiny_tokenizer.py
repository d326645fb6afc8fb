"""A tiny word-level Hugging Face tokenizer, built and saved by the `tokenizers` library."""

import os

from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

WORDS = "the quick brown fox jumps over a lazy dog while cats sit on warm mats".split()
VOCAB_SIZE = len(set(WORDS)) + 3  # with <unk>, <s> and </s>


def save_tokenizer(folder, special_tokens=("<unk>", "<s>", "</s>"), bos=True) -> str:
    """A word-level tokenizer of WORDS (a BOS put first by its post-processor, as Llama's is),
    saved as `folder`/tokenizer.json; returns the folder."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=list(special_tokens))
    tokenizer.train_from_iterator([" ".join(WORDS)], trainer)
    if bos:
        bos_id = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos_id)]
        )
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    return str(folder)
