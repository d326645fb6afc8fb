"""A text file tokenized once, a piece at a time, into a token file in the data dir, then mapped.

A Hugging Face tokenizer encodes 0.4 to 1.5 MB of text a second here, and a large file's tokens need
not fit in memory: the file is read in pieces (`text.read_text_pieces`), encoded a piece at a time
(`TextTokenizer.encode_pieces`) and the tokens appended to
`<data_dir>/tokenized/<file name>-<key>.<uint16|uint32>` (uint16 while the vocabulary fits),
written under a temporary name and renamed, then memory-mapped. The key digests the file's
identity (device, inode, size, modification time) and the tokenizer's: a job's processes, its
loader workers and later runs read the one file; a changed text or tokenizer is encoded again.
"""

import glob
import hashlib
import os

import numpy as np

from jddp.data import text
from jddp.data import tokenizer as tokenizer_lib
from jddp.errors import DataError
from jddp.runtime import atomic_write
from jddp.runtime.fs import directory_problem

FOLDER = "tokenized"  # under the data dir, beside TFDS's datasets and `decoded/`


class MappedTokens(text.TokenReads):
    """Tokens [start, stop) of a token file, memory-mapped, read as int32. Pickled (to a loader
    worker), it carries the path, and the worker maps the same file."""

    def __init__(self, path: str, dtype: str, start: int = 0, stop: int | None = None):
        self.path, self.dtype = path, np.dtype(dtype)
        empty = os.path.getsize(path) == 0  # np.memmap refuses an empty file
        self._tokens = np.zeros(0, self.dtype) if empty else np.memmap(path, self.dtype, "r")
        self.start, self.stop = start, len(self._tokens) if stop is None else stop

    def __reduce__(self):
        return MappedTokens, (self.path, self.dtype.str, self.start, self.stop)

    def __len__(self) -> int:
        return self.stop - self.start

    def part(self, start: int, stop: int) -> "MappedTokens":
        """Tokens [start, stop) of these, mapping the same file."""
        return MappedTokens(self.path, self.dtype.str, self.start + start, self.start + stop)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int32 [len(starts), length]: the tokens from each start (relative to this part)."""
        first = self.start + np.asarray(starts, np.int64)
        return self._tokens[first[:, None] + np.arange(length)].astype(np.int32)


def tokenized_text_file(path: str, tokenizer, data_dir: str, exclusive):
    """The tokens of text file `path` (one document: `tokenizer.pack` of its text) as
    `MappedTokens` of its token file under `data_dir`, encoded now if no run made it before.
    `exclusive(lock_path)` is held while looking and encoding, so one process encodes. A data dir
    nobody can write to: the tokens are encoded (a piece at a time) into memory."""
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    identity = _identity(path)
    rule = (tokenizer_lib.PIECE_CHARS, tokenizer_lib.CUT_CONTEXT)  # how it was cut into encodes
    key = hashlib.sha256(repr((identity, tokenizer.identity(), rule)).encode())
    folder = os.path.join(data_dir, FOLDER)
    name = f"{os.path.basename(path)}-{key.hexdigest()[:20]}.{dtype.name}"
    target = os.path.join(folder, name)
    with exclusive(os.path.join(folder, f".{name}.lock")):
        if not os.path.exists(target):
            if directory_problem(folder, write=True):
                return text.compact(np.concatenate(list(_encoded(path, tokenizer))))
            try:
                _write(target, path, identity, tokenizer, dtype)
            except OSError as e:
                raise DataError(
                    f"the tokens of data.text_file {path!r} cannot be written to {folder!r}: "
                    f"{e.strerror}; free space there, or set --config.data.data_dir to another "
                    "folder"
                ) from None
    return MappedTokens(target, dtype.str)


def _encoded(path: str, tokenizer):
    return tokenizer.encode_pieces(text.read_text_pieces(path, tokenizer_lib.PIECE_CHARS))


def _identity(path: str) -> tuple:
    try:
        return text.file_identity(path)
    except OSError as e:
        raise DataError(f"data.text_file {path!r} cannot be read: {e.strerror}") from None


def _write(target: str, path: str, identity: tuple, tokenizer, dtype: np.dtype) -> None:
    """The tokens into `target`: written under a temporary name, flushed to disk and renamed, so
    the name is only ever a whole file (and not made if `path` changed while it was encoded).
    Called under the lock: a temporary file of the same name left behind is a dead encode's."""
    folder, name = os.path.split(target)
    os.makedirs(folder, exist_ok=True)
    left_by = f".{glob.escape(name)}.*{atomic_write.TEMPORARY_SUFFIX}"
    for left in glob.glob(os.path.join(glob.escape(folder), left_by)):
        os.unlink(left)
    with atomic_write.replacing(target, binary=True) as out:
        for ids in _encoded(path, tokenizer):
            out.write(ids.astype(dtype).tobytes())
        if _identity(path) != identity:  # nothing is published
            raise DataError(
                f"data.text_file {path!r} changed while it was tokenized; leave it unchanged "
                "while a run reads it"
            )
