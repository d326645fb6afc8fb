"""A text file with a Hugging Face tokenizer: read and encoded a bounded piece at a time into a
token file in the data dir, memory-mapped, and reused while the file and the tokenizer stay the
same. The references are whole-text encodes by the `tokenizers` library itself."""

import dataclasses
import itertools
import os
import pickle

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jddp import data
from jddp.data import text, token_file
from jddp.data import tokenizer as tokenizer_lib
from tests.helpers import run_in_fresh_process
from tests.tiny_tokenizer import WORDS, save_tokenizer

PIECE_CHARS = 3000  # pieces this small make a 100 KB text dozens of encodes


class RecordedTokenizer:
    """A `tokenizers.Tokenizer` that records the length of every text it encodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def encode(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):  # to_str, truncation, padding, decode ...
        return getattr(self.tokenizer, name)


def corpus(seed: int) -> str:
    """Lines of words (some unknown, some with a two-byte character), and one line far longer
    than a piece, so pieces end at line breaks and at spaces."""
    rng = np.random.default_rng(seed)
    words = WORDS + ["zebra", "café", "fox."]
    lines = [" ".join(rng.choice(words, rng.integers(1, 15))) for _ in range(2500)]
    lines.insert(1000, " ".join(rng.choice(words, 2 * PIECE_CHARS // 4)))
    return "\n".join(lines) + "\n"


def whole_encode(folder, text_: str) -> np.ndarray:
    """The reference: the whole text in one encode (BOS by the post-processor), then </s>."""
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    return np.array(tokenizer.encode(text_).ids + [tokenizer.token_to_id("</s>")])


def stored_files(data_dir) -> list[str]:
    """The token files in `data_dir` (not their lock files)."""
    return [n for n in os.listdir(data_dir / token_file.FOLDER) if not n.startswith(".")]


def open_recorded(options):
    """The text_file dataset opened with its tokenizer's encodes recorded."""
    spec = data.get_dataset("text_file", options=options)
    recorded = RecordedTokenizer(spec.tokenizer.tokenizer)
    spec = dataclasses.replace(
        spec, tokenizer=dataclasses.replace(spec.tokenizer, tokenizer=recorded)
    )
    return data.open_dataset(spec, options), recorded.lengths


def test_a_text_file_is_encoded_once_in_pieces_into_a_mapped_token_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_lib, "PIECE_CHARS", PIECE_CHARS)
    folder = save_tokenizer(tmp_path / "tokenizer")
    path, data_dir = tmp_path / "corpus.txt", tmp_path / "data"
    path.write_text(corpus(seed=0), encoding="utf-8")
    options = data.DataOptions(
        text_file=str(path), tokenizer=folder, seq_len=8, data_dir=str(data_dir)
    )
    expected = whole_encode(folder, path.read_text(encoding="utf-8"))
    cut = int(len(expected) * (1 - text.TEXT_FILE_TEST_FRACTION))

    opened, lengths = open_recorded(options)
    # Dozens of encodes, none longer than a piece with the text held at a cut.
    assert len(lengths) > 30 and max(lengths) <= PIECE_CHARS + tokenizer_lib.HELD_CHARS
    (stored,) = stored_files(data_dir)
    assert stored.startswith("corpus.txt-") and stored.endswith(".uint16")
    on_disk = np.fromfile(data_dir / token_file.FOLDER / stored, np.uint16)
    np.testing.assert_array_equal(on_disk, expected)
    np.testing.assert_array_equal(opened.train.tokens, expected[:cut])
    np.testing.assert_array_equal(opened.eval.tokens, expected[cut:])
    batch = opened.eval.read_batch([0, 2])
    np.testing.assert_array_equal(
        batch["tokens"], [expected[cut : cut + 9], expected[cut + 16 : cut + 25]]
    )
    # A loader worker gets the path, not the tokens.
    assert len(pickle.dumps(opened.train.tokens)) < 1000
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(opened.train.tokens)), expected[:cut])

    again, lengths = open_recorded(options)  # the same file and tokenizer: no encode
    assert lengths == []
    np.testing.assert_array_equal(again.eval.tokens, expected[cut:])

    changed = corpus(seed=1)  # the file rewritten: encoded again, the old token file left alone
    path.write_text(changed, encoding="utf-8")
    os.utime(path, ns=(1, 1))  # another mtime even on a coarse clock
    expected = whole_encode(folder, changed)
    cut = int(len(expected) * (1 - text.TEXT_FILE_TEST_FRACTION))
    opened, lengths = open_recorded(options)
    assert lengths and len(stored_files(data_dir)) == 2
    np.testing.assert_array_equal(opened.train.tokens, expected[:cut])

    # A data dir that cannot be made: the tokens, still encoded in pieces, are kept in memory.
    (tmp_path / "a_file").write_text("")
    options = dataclasses.replace(options, data_dir=str(tmp_path / "a_file" / "data"))
    opened, lengths = open_recorded(options)
    assert max(lengths) <= PIECE_CHARS + tokenizer_lib.HELD_CHARS
    np.testing.assert_array_equal(opened.eval.tokens, expected[cut:])


def test_text_pieces_end_at_line_breaks_else_spaces(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(corpus(seed=2), encoding="utf-8")
    pieces = list(text.read_text_pieces(str(path), PIECE_CHARS))
    assert "".join(pieces) == path.read_text(encoding="utf-8")
    assert all(len(piece) <= PIECE_CHARS for piece in pieces)
    ends = [piece[-1] for piece in pieces[:-1]]
    assert set(ends) == {"\n", " "}  # the long line is cut at spaces


def byte_level_bpe(sample: str):
    """A GPT-2-style tokenizer (byte-level BPE, no added tokens) trained on `sample`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    tokenizer.train_from_iterator([sample], trainer)
    return tokenizer


def sentencepiece_bpe(sample: str):
    """A Llama-2-style tokenizer (a word-start marker put first, BPE, a BOS) trained on `sample`."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator([sample], trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tokenizer.enable_truncation(64)  # as a tokenizer.json may set it: a piece is never truncated
    return tokenizer


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_bpe])
def test_pieces_cut_anywhere_give_the_whole_texts_tokens(make):
    sample = corpus(seed=3)[:40_000] + "\n\n  fox  \n"
    tokenizer = make(sample)
    eos = tokenizer.get_vocab_size() - 1
    wrapped = tokenizer_lib.TextTokenizer("tokenizer.json", "eos", eos, eos + 1, tokenizer)
    tokenizer.no_truncation()
    expected = tokenizer.encode(sample).ids + [eos]
    # Cuts inside words, inside runs of spaces and line breaks: a per-piece encode differs.
    cuts = np.cumsum(np.random.default_rng(0).integers(1, 3000, 40))
    cuts = [0, *cuts[cuts < len(sample)].tolist(), len(sample)]
    pieces = [sample[a:b] for a, b in itertools.pairwise(cuts)]
    naive = [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False).ids]
    assert naive != expected[1:-1] and naive != expected[:-1]
    tokenizer.enable_truncation(64)
    np.testing.assert_array_equal(np.concatenate(list(wrapped.encode_pieces(pieces))), expected)


TOKENIZE_IN_A_FRESH_PROCESS = """
import json
from jddp import data

def megabytes(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))

options = data.DataOptions(text_file=PATH, tokenizer=FOLDER, data_dir=DATA_DIR, seq_len=64)
spec = data.get_dataset("text_file", options=options)
before = megabytes("VmRSS:")
opened = data.open_dataset(spec, options)
print(json.dumps({"grown_mb": megabytes("VmHWM:") - before,
                  "tokens": len(opened.train.tokens) + len(opened.eval.tokens)}))
"""
# In pieces the peak grew by 47 MB here; one encode of the whole 2.7 MB text grew it by 343 MB.
TOKENIZE_BOUND_MB = 100


def test_tokenizing_a_text_file_takes_memory_bounded_by_a_piece(tmp_path):
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, 12)) for _ in range(50_000)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines))  # 2.7 MB: a dozen encodes
    program = (
        TOKENIZE_IN_A_FRESH_PROCESS.replace("PATH", repr(str(path)))
        .replace("FOLDER", repr(save_tokenizer(tmp_path / "tokenizer")))
        .replace("DATA_DIR", repr(str(tmp_path / "data")))
    )
    result = run_in_fresh_process(program)
    assert result["tokens"] == 12 * len(lines) + 2  # a word a token, the BOS and </s>
    assert result["grown_mb"] < TOKENIZE_BOUND_MB, result["grown_mb"]
