"""Text tokenized by a Hugging Face tokenizer (`data.tokenizer`), documents packed into one stream.

Each document becomes `tokenizer.encode(text).ids` (the tokenizer's own post-processing: a Llama
tokenizer puts its BOS first) followed by the end-of-document token; the documents are
concatenated in order. The stream is then cut into the same token windows as character-level
text (text.py), so order, shuffling, resume and per-process reading stay those of every source.

Eval split by a fraction: the last fraction of the documents where there are several, else (one
document, as a text file is) the last fraction of its tokens.
"""

import dataclasses
import json
import os

import numpy as np

from jddp.errors import ConfigError, DataError

TOKENIZER_FILE = "tokenizer.json"  # what `save_pretrained` writes for a fast tokenizer
CONFIG_FILE = "tokenizer_config.json"  # beside it: its special tokens, eos_token among them
# Llama 2 / Mistral, GPT-2, Llama 3, Gemma.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
# Ids may leave gaps (added tokens), but an embedding of more than twice the rows the tokenizer
# has tokens for is a damaged file (an id of 2**31 would size it), not a vocabulary.
MAX_ID_SPREAD = 2
_ENCODE_CHUNK = 1024  # documents per encode_batch call: bounds the Encoding objects held at once


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A loaded `tokenizer.json` with its end-of-document token; `vocab_size` is the number of
    outputs a language model needs (every id it can give is below it)."""

    file: str
    eos_token: str
    eos_id: int
    vocab_size: int
    tokenizer: object = dataclasses.field(compare=False, repr=False)  # a tokenizers.Tokenizer

    def pack(self, documents) -> np.ndarray:
        """The documents as one int32 stream: each one's ids, then the end-of-document id."""
        pieces = []
        documents = list(documents)
        for start in range(0, len(documents), _ENCODE_CHUNK):
            for encoding in self.tokenizer.encode_batch(documents[start : start + _ENCODE_CHUNK]):
                pieces.append(np.asarray(encoding.ids, np.int32))
                pieces.append(np.array([self.eos_id], np.int32))
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)

    def check_fits(self, vocab_size: int, model: str, fix: str) -> None:
        """A DataError unless every id this tokenizer gives is below `vocab_size`, the
        vocabulary of `model` (a checkpoint); `fix` ends the line."""
        if self.vocab_size > vocab_size:
            largest = self.vocab_size - 1
            raise DataError(
                f"data.tokenizer {self.file} gives ids up to {largest} "
                f"({self.tokenizer.id_to_token(largest)!r}), beyond the {vocab_size} tokens of "
                f"{model}; {fix}"
            )

    def decode(self, tokens) -> str:
        """Token ids back to text, special tokens (the end-of-document token) kept."""
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=False)


def load_tokenizer(path: str, eos_token: str = "") -> TextTokenizer:
    """The tokenizer at `path` (a tokenizer.json, or a directory holding one) and its
    end-of-document token: `eos_token`, else found (`find_eos_token`); one line if not."""
    file = _tokenizer_file(path)
    from tokenizers import Tokenizer  # only runs that tokenize need the package loaded

    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # the Rust reader's own message: "expected value at line 1 ..."
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise DataError(
            f"data.tokenizer {path!r} is not a tokenizer file ({reason}); pass the tokenizer.json "
            "of a Hugging Face fast tokenizer, or the directory save_pretrained wrote it to"
        ) from None
    vocabulary = tokenizer.get_vocab(with_added_tokens=True)
    if eos_token:
        if eos_token not in vocabulary:
            raise ConfigError(
                f"data.eos_token {eos_token!r} is not in the vocabulary of {file}; set "
                "--config.data.eos_token to one of its tokens (or '' to find it)"
            )
    else:
        eos_token = find_eos_token(file, vocabulary)
    # Ids of added tokens may leave gaps: the model needs an output for the largest id too.
    largest_id = max(vocabulary.values(), default=-1)
    size = max(tokenizer.get_vocab_size(with_added_tokens=True), largest_id + 1)
    if size > MAX_ID_SPREAD * len(vocabulary):  # the largest id sizes the embedding
        token = next(t for t, i in vocabulary.items() if i == largest_id)
        raise DataError(
            f"data.tokenizer {file} gives {token!r} the id {largest_id}, though it has "
            f"{len(vocabulary)} tokens (a damaged or edited tokenizer.json?); pass a tokenizer "
            "whose ids number its tokens"
        )
    return TextTokenizer(file, eos_token, vocabulary[eos_token], size, tokenizer)


def find_eos_token(file: str, vocabulary: dict) -> str:
    """The `eos_token` of a tokenizer_config.json beside `file`, else the first of
    EOS_CANDIDATES in `vocabulary`; a ConfigError naming data.eos_token if none is."""
    configured = _configured_eos(os.path.join(os.path.dirname(file), CONFIG_FILE))
    if configured and configured in vocabulary:
        return configured
    found = next((token for token in EOS_CANDIDATES if token in vocabulary), "")
    if found:
        return found
    looked = f"{CONFIG_FILE}'s eos_token {configured!r}, " if configured else ""
    raise ConfigError(
        f"{file} has no end-of-document token (looked for {looked}{', '.join(EOS_CANDIDATES)}); "
        "set --config.data.eos_token to one of its tokens"
    )


def _configured_eos(path: str) -> str:
    """The eos_token a tokenizer_config.json names ("" if none): a string, or an AddedToken
    dict's content."""
    try:
        with open(path, encoding="utf-8") as f:
            token = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return ""  # absent or unreadable: the candidates decide
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _tokenizer_file(path: str) -> str:
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        file = os.path.join(path, TOKENIZER_FILE)
        if os.path.isfile(file):
            return file
        slow = [n for n in ("tokenizer.model", "vocab.json") if os.path.isfile(f"{path}/{n}")]
        hint = (
            f" (it has {slow[0]}: a slow tokenizer; write tokenizer.json with transformers' "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
            if slow
            else ""
        )
        raise DataError(
            f"data.tokenizer {path!r} holds no {TOKENIZER_FILE}{hint}; pass a tokenizer.json or "
            "a directory holding one"
        )
    if not os.path.isfile(path):
        raise DataError(
            f"data.tokenizer {path!r} does not exist; pass a tokenizer.json or a directory "
            "holding one"
        )
    return path


def held_out_documents(count: int, fraction: float, where: str) -> int:
    """How many of `count` documents (at least 2) the last `fraction` is: at least one, and
    never all of them (one line if it would be)."""
    held = max(1, round(count * fraction))
    if held >= count:
        raise DataError(
            f"{where} has {count} documents: holding out {fraction:g} of them leaves none to "
            "train on; use a smaller data.eval_fraction or more documents"
        )
    return held


def split_tokens(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(the first 1 - `fraction` of `tokens`, the last `fraction`): one document's split."""
    cut = int(len(tokens) * (1 - fraction))
    return tokens[:cut], tokens[cut:]
