"""Character-level text: a vocabulary, text as token ids, and token windows as examples.

Token i is character `vocabulary[i]`; vocabularies are sorted by code point. A split's text is one
token sequence; its examples are windows of it (`TokenWindows`), which `transforms.NextCharacter`
turns into `inputs` and `targets`. Text tokenized by a Hugging Face tokenizer (tokenizer.py) is
one token array as well (a text file's, a memory-mapped token file: token_file.py), cut into the
same windows.

A text file is never held whole: `scan_text_file` reads it a chunk at a time for its vocabulary,
its length in characters and a small index (the characters before every block of bytes), and
`TextTokens` reads the characters a batch's windows cover straight from the file, so a process's
memory does not grow with the file.
"""

import codecs
import dataclasses
import functools
import os
from collections.abc import Iterator

import numpy as np

from jddp.errors import ConfigError, DataError, DataUnreadable

TEXT_FILE_TEST_FRACTION = 0.1  # a local text file: the last 10% of its characters is the test split
SCAN_CHUNK_BYTES = 1 << 20  # bytes read at a time while scanning: the scan's memory
INDEX_BLOCK_BYTES = 4096  # the index counts characters per block: 2 KiB of index per MiB of text
_ENCODE_CHUNK = 1 << 20  # characters encoded at a time: bounds encode's temporaries


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)


def _lookup(vocabulary: str) -> np.ndarray:
    """Code point -> token id (-1: not in the vocabulary); code points past its end are -1 too."""
    codes = _code_points(vocabulary)
    table = np.full(max(int(codes.max(initial=0)) + 2, 256), -1, np.int32)
    table[codes] = np.arange(len(codes), dtype=np.int32)
    return table


def _token_ids(codes: np.ndarray, lookup: np.ndarray, where: str) -> np.ndarray:
    # Bytes always fall in the table; a larger code point past its end reads its last entry, -1.
    ids = lookup[codes if codes.dtype == np.uint8 else np.minimum(codes, len(lookup) - 1)]
    unknown = ids < 0
    if unknown.any():
        raise DataError(
            f"{where} has a character outside its vocabulary: {chr(codes[unknown][0])!r}"
        )
    return ids


def encode(text: str, vocabulary: str, where: str) -> np.ndarray:
    """`text` as int32 token ids; a character outside `vocabulary` is a DataError."""
    lookup, tokens = _lookup(vocabulary), np.empty(len(text), np.int32)
    for start in range(0, len(text), _ENCODE_CHUNK):
        piece = text[start : start + _ENCODE_CHUNK]
        tokens[start : start + len(piece)] = _token_ids(_code_points(piece), lookup, where)
    return tokens


def decode(tokens, vocabulary: str) -> str:
    """Token ids back to text (for samples from a language model)."""
    return "".join(vocabulary[int(t)] for t in np.asarray(tokens))


def compact(tokens):
    """An array of token ids in the smallest unsigned type that holds them (a character
    vocabulary fits a byte, most tokenizers' two); anything else as it is."""
    if not isinstance(tokens, np.ndarray) or not len(tokens) or tokens.min() < 0:
        return tokens
    largest = int(tokens.max())
    kind = next((k for k in (np.uint8, np.uint16) if largest <= np.iinfo(k).max), tokens.dtype)
    return tokens.astype(kind, copy=False)


def token_windows(tokens, starts: np.ndarray, length: int) -> np.ndarray:
    """int32 rows `tokens[s : s + length]` for each start: an array's by indexing, else the
    source's own reads."""
    if isinstance(tokens, np.ndarray):
        return tokens[starts[:, None] + np.arange(length)].astype(np.int32, copy=False)
    return tokens.windows(starts, length)


class TokenWindows:
    """A random-access source: example i is `{"tokens": tokens[i*stride : i*stride + length]}`
    as int32 (`tokens`: an array, kept `compact`, or a file's `TextTokens`)."""

    def __init__(self, tokens, length: int, stride: int, where: str, unit: str = "characters"):
        if len(tokens) < length:
            raise DataError(
                f"{where} has {len(tokens)} {unit}, fewer than one example needs ({length}); "
                "use a smaller --config.data.seq_len or more text"
            )
        self.tokens, self.length, self.stride = compact(tokens), length, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.length) // self.stride + 1

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        starts = np.asarray(indices, np.int64) * self.stride
        return {"tokens": token_windows(self.tokens, starts, self.length)}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: rows[0] for name, rows in self.read_batch([index]).items()}


def language_model_windows(tokens, seq_len: int, train: bool, where: str, unit: str = "characters"):
    """Examples of a split: in training, windows of 2 x seq_len tokens every seq_len tokens (the
    transform cuts seq_len + 1 at a random offset), else windows of seq_len + 1 every seq_len, so
    each token is a target exactly once. `unit` names the tokens in messages."""
    if train:
        return TokenWindows(tokens, 2 * seq_len, seq_len, where, unit)
    return TokenWindows(tokens, seq_len + 1, seq_len, where, unit)


def _check_text_path(path: str) -> None:
    if not path:
        raise ConfigError("dataset text_file needs a file: set --config.data.text_file=PATH")
    if os.path.isdir(path):
        raise DataError(f"data.text_file {path!r} is a directory; pass a path to a UTF-8 text file")
    if not os.path.isfile(path):
        raise DataError(f"data.text_file {path!r} does not exist; pass a path to a UTF-8 text file")


def _not_utf8(path: str, error: UnicodeDecodeError, start: int) -> DataError:
    return DataError(
        f"data.text_file {path!r} is not UTF-8 text ({error.reason} at byte {start}); convert it "
        "to UTF-8"
    )


def _too_few_characters(path: str) -> DataError:
    return DataError(f"data.text_file {path!r} holds fewer than 2 distinct characters")


def read_text_pieces(path: str, max_chars: int) -> Iterator[str]:
    """The UTF-8 text of `path` in successive pieces of at most `max_chars` characters (a
    tokenizer's input), each but the last ending after its last line break, else after its last
    space or tab; the file is read SCAN_CHUNK_BYTES at a time, never whole. A DataError for a
    file that is not UTF-8."""
    _check_text_path(path)
    decoder, text, offset = codecs.getincrementaldecoder("utf-8")(), "", 0
    try:
        with open(path, "rb") as f:
            while True:
                chunk, pending = f.read(SCAN_CHUNK_BYTES), decoder.getstate()[0]
                try:
                    text += decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    raise _not_utf8(path, e, offset - len(pending) + e.start) from None
                offset += len(chunk)
                while len(text) > max_chars or (text and not chunk):
                    piece = text[:max_chars]
                    cut = _piece_end(piece) if len(text) > max_chars else len(piece)
                    yield piece[:cut]
                    text = text[cut:]
                if not chunk:
                    return
    except OSError as e:
        raise DataError(f"data.text_file {path!r} cannot be read: {e.strerror}") from None


def _piece_end(piece: str) -> int:
    """Where to cut `piece`: after its last line break, else its last space or tab, else at its
    end (a line with no space in `max_chars` characters)."""
    return piece.rfind("\n") + 1 or max(piece.rfind(" "), piece.rfind("\t")) + 1 or len(piece)


@dataclasses.dataclass(frozen=True, eq=False)
class TextFileIndex:
    """What one pass over a UTF-8 file found: its characters and where they are."""

    path: str
    identity: tuple  # (device, inode, size, mtime_ns) when scanned: a changed file is noticed
    characters: int
    vocabulary: str  # its distinct characters, sorted by code point
    block_bytes: int
    block_first: np.ndarray  # int64: the index of the first character starting in each block
    ascii: bool  # one byte per character: character i is byte i


def _identity(stat: os.stat_result) -> tuple:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def file_identity(path: str) -> tuple:
    """(device, inode, size, mtime_ns) of `path`: another value is another file, or changed."""
    return _identity(os.stat(path))


def scan_text_file(path: str) -> TextFileIndex:
    """`path` read once, SCAN_CHUNK_BYTES at a time (a DataError for a file that is not UTF-8 or
    holds fewer than 2 distinct characters); the same file again is not read again."""
    _check_text_path(path)
    chunk_bytes, block_bytes = SCAN_CHUNK_BYTES, INDEX_BLOCK_BYTES
    if chunk_bytes % block_bytes:
        raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of {block_bytes}")
    try:
        identity = _identity(os.stat(path))
        return _scan(path, identity, chunk_bytes, block_bytes)
    except OSError as e:
        raise DataError(f"data.text_file {path!r} cannot be read: {e.strerror}") from None


@functools.lru_cache(maxsize=4)  # get_dataset reads the vocabulary, open_dataset the index
def _scan(path: str, identity: tuple, chunk_bytes: int, block_bytes: int) -> TextFileIndex:
    ascii_seen, others = np.zeros(128, bool), set()
    decoder = codecs.getincrementaldecoder("utf-8")()
    block_counts, offset, ascii = [], 0, True
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            octets = np.frombuffer(chunk, np.uint8)
            starts = (octets & 0xC0) != 0x80  # a character starts at every non-continuation byte
            block_counts.append(
                np.add.reduceat(starts, np.arange(0, len(chunk), block_bytes), dtype=np.int64)
            )
            pending = decoder.getstate()[0]
            if not pending and chunk.isascii():
                ascii_seen[octets] = True
            else:
                ascii = False
                try:
                    codes = _code_points(decoder.decode(chunk))
                except UnicodeDecodeError as e:
                    raise _not_utf8(path, e, offset - len(pending) + e.start) from None
                low = codes < 128
                ascii_seen[codes[low]] = True
                others.update(np.unique(codes[~low]).tolist())
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:  # the file ends inside a character
        raise _not_utf8(path, e, offset - len(decoder.getstate()[0]) + e.start) from None
    codes = sorted(np.flatnonzero(ascii_seen).tolist() + list(others))
    if len(codes) < 2:
        raise _too_few_characters(path)
    counts = np.concatenate(block_counts)
    block_first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return TextFileIndex(
        path, identity, int(counts.sum()), "".join(map(chr, codes)), block_bytes, block_first,
        ascii,
    )  # fmt: skip


class TokenReads:
    """Slices and `np.asarray` of a token source that is read a window at a time (`len` and
    `windows(starts, length)`), as int32 arrays."""

    def __getitem__(self, part: slice) -> np.ndarray:
        start, stop, step = part.indices(len(self))
        if step != 1:
            raise ValueError(f"{type(self).__name__} are sliced with a step of 1")
        if stop <= start:
            return np.zeros(0, np.int32)
        return self.windows(np.array([start]), stop - start)[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        tokens = self[:]
        return tokens if dtype is None else tokens.astype(dtype)


class TextTokens(TokenReads):
    """Characters [start, stop) of a scanned file as int32 token ids, read from the file when
    asked: `len`, slices, `windows` and `np.asarray` as a 1-D token array would. Pickled (to a
    loader worker), it carries the index, not the text."""

    def __init__(self, index: TextFileIndex, vocabulary: str, start: int = 0, stop=None):
        self.index, self.vocabulary = index, vocabulary
        self.start, self.stop = start, index.characters if stop is None else stop
        self._lookup, self._file = _lookup(vocabulary), None

    def __reduce__(self):  # the open file stays behind; a worker opens its own
        return TextTokens, (self.index, self.vocabulary, self.start, self.stop)

    def __len__(self) -> int:
        return self.stop - self.start

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int32 [len(starts), length]: the tokens from each start (relative to this split)."""
        first = self.start + np.asarray(starts, np.int64)
        if self.index.ascii:
            raw = b"".join(self._read(int(a), length) for a in first)
            codes = np.frombuffer(raw, np.uint8)
        else:
            codes = _code_points("".join(self._characters(int(a), length) for a in first))
        if len(codes) != len(first) * length:
            raise self._changed()
        ids = _token_ids(codes, self._lookup, f"data.text_file {self.index.path!r}")
        return ids.reshape(len(first), length)

    def _characters(self, first: int, count: int) -> str:
        """Characters [first, first + count) of the file: decoded from the start of the block
        the first one starts in."""
        index, size = self.index, self.index.identity[2]
        block = int(np.searchsorted(index.block_first, first, "right")) - 1
        last_block = int(np.searchsorted(index.block_first, first + count - 1, "right")) - 1
        begin = block * index.block_bytes
        raw = self._read(begin, min((last_block + 1) * index.block_bytes + 3, size) - begin)
        # The file was checked whole: "ignore" drops only the parts of the characters `raw` cuts,
        # the previous one's continuation bytes at its start and a character cut off at its end.
        text = raw.decode("utf-8", "ignore")
        offset = first - int(index.block_first[block])
        return text[offset : offset + count]

    def _read(self, offset: int, count: int) -> bytes:
        try:
            if self._file is None:
                file = open(self.index.path, "rb")  # held while the source lives
                if _identity(os.fstat(file.fileno())) != self.index.identity:
                    file.close()
                    raise self._changed()
                self._file = file
            return os.pread(self._file.fileno(), count, offset)
        except FileNotFoundError:
            raise self._changed() from None
        except OSError as e:  # the file system's error: a later try may read it
            raise DataUnreadable(
                f"data.text_file {self.index.path!r} cannot be read: {e.strerror}; run again "
                "once it can"
            ) from None

    def _changed(self) -> DataError:
        return DataError(
            f"data.text_file {self.index.path!r} changed since it was read; leave it unchanged "
            "while a run reads it (or restart the run)"
        )


def text_file_tokens(path: str, vocabulary: str) -> dict[str, TextTokens]:
    """{"train": the first 90% of the file's characters, "test": the last 10%} as tokens read
    on demand; a DataError if the file's vocabulary is no longer `vocabulary`."""
    index = scan_text_file(path)
    if index.vocabulary != vocabulary:
        raise DataError(
            f"data.text_file {path!r} changed since its vocabulary was read; leave it unchanged "
            "while a run reads it"
        )
    cut = int(index.characters * (1 - TEXT_FILE_TEST_FRACTION))
    return {
        "train": TextTokens(index, vocabulary, 0, cut),
        "test": TextTokens(index, vocabulary, cut, index.characters),
    }
