"""Character-level text: a vocabulary, text as token ids, and token windows as examples.

Token i is character `vocabulary[i]`; vocabularies are sorted by code point. A split's text is one
token array; its examples are windows of it (`TokenWindows`), which `transforms.NextCharacter`
turns into `inputs` and `targets`. Text tokenized by a Hugging Face tokenizer (tokenizer.py) is
one token array as well, cut into the same windows.
"""

import os

import numpy as np

from jddp.errors import ConfigError, DataError

TEXT_FILE_TEST_FRACTION = 0.1  # a local text file: the last 10% of its characters is the test split


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)


def encode(text: str, vocabulary: str, where: str) -> np.ndarray:
    """`text` as int32 token ids; a character outside `vocabulary` is a DataError."""
    codes, vocab = _code_points(text), _code_points(vocabulary)
    ids = np.minimum(np.searchsorted(vocab, codes), len(vocab) - 1)
    unknown = vocab[ids] != codes
    if unknown.any():
        raise DataError(
            f"{where} has a character outside its vocabulary: {chr(codes[unknown][0])!r}"
        )
    return ids.astype(np.int32)


def decode(tokens, vocabulary: str) -> str:
    """Token ids back to text (for samples from a language model)."""
    return "".join(vocabulary[int(t)] for t in tokens)


class TokenWindows:
    """A random-access source: example i is `{"tokens": tokens[i*stride : i*stride + length]}`."""

    def __init__(
        self, tokens: np.ndarray, length: int, stride: int, where: str, unit: str = "characters"
    ):
        if len(tokens) < length:
            raise DataError(
                f"{where} has {len(tokens)} {unit}, fewer than one example needs ({length}); "
                "use a smaller --config.data.seq_len or more text"
            )
        self.tokens, self.length, self.stride = tokens, length, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.length) // self.stride + 1

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        starts = np.asarray(indices, np.int64) * self.stride
        return {"tokens": self.tokens[starts[:, None] + np.arange(self.length)]}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: rows[0] for name, rows in self.read_batch([index]).items()}


def language_model_windows(
    tokens: np.ndarray, seq_len: int, train: bool, where: str, unit: str = "characters"
):
    """Examples of a split: in training, windows of 2 x seq_len tokens every seq_len tokens (the
    transform cuts seq_len + 1 at a random offset), else windows of seq_len + 1 every seq_len, so
    each token is a target exactly once. `unit` names the tokens in messages."""
    if train:
        return TokenWindows(tokens, 2 * seq_len, seq_len, where, unit)
    return TokenWindows(tokens, seq_len + 1, seq_len, where, unit)


def read_text_file(path: str) -> str:
    """The UTF-8 text of `path`, or a DataError naming the problem."""
    if not path:
        raise ConfigError("dataset text_file needs a file: set --config.data.text_file=PATH")
    if os.path.isdir(path):
        raise DataError(f"data.text_file {path!r} is a directory; pass a path to a UTF-8 text file")
    if not os.path.isfile(path):
        raise DataError(f"data.text_file {path!r} does not exist; pass a path to a UTF-8 text file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(
            f"data.text_file {path!r} is not UTF-8 text ({e.reason} at byte "
            f"{e.start}); convert it to UTF-8"
        ) from None
    except OSError as e:
        raise DataError(f"data.text_file {path!r} cannot be read: {e.strerror}") from None
    if len(set(text)) < 2:
        raise DataError(f"data.text_file {path!r} holds fewer than 2 distinct characters")
    return text


def text_file_splits(text: str) -> dict[str, str]:
    """{"train": the first 90% of the characters, "test": the last 10%}."""
    cut = int(len(text) * (1 - TEXT_FILE_TEST_FRACTION))
    return {"train": text[:cut], "test": text[cut:]}
