"""Packing (`data.packing=true`): several examples or documents per row, kept apart.

Instruction examples (rows of up to seq_len + 1 tokens, instruction.py) are laid end to end into
rows of seq_len + 1 tokens, greedily in their order (next-fit, the rule of T5's and MaxText's
`pack_dataset`): a row takes the next example while it fits and is closed, padded, by the first
that does not. Rows are formed once, over the whole split, from the examples' lengths alone, so
they do not depend on the device or process count, and resume and per-process reading stay
exact. Each row carries `segments` (1, 2, ... per example, 0 on padding) and `positions` (each
token's position in its example, from 0), which the decoder models use to keep attention within
an example and to restart their positions (jddp/models/decoder.py).

Documents (rows of text tokenized by `data.tokenizer`, each ended by the end-of-document token in
one stream: tokenizer.py) keep their windows, cut from the stream with no padding
(`DocumentWindows`); what keeps them apart is read from each window's tokens alone, so order,
resume and per-process reading stay those of unpacked text. A new document starts after each
end-of-document token. A document cut at a window's edge continues in the next window as its first
segment, its positions restarting at 0 there: what grain's concat-then-split packing (MaxText's
`grain_packing_type=concat_then_split`) gives, and Levanter's windows, whose positions are the
window's own.
"""

import dataclasses

import numpy as np

from jddp.data.instruction import POSITIONS, SEGMENT_IDS
from jddp.data.transforms import NextCharacter
from jddp.losses import LOSS_MASK

PAD_SEGMENT = 0


def row_starts(lengths, capacity: int) -> np.ndarray:
    """The index of each row's first example, and the number of examples last: examples of
    `lengths` (each <= `capacity`) packed greedily in order into rows of `capacity` tokens."""
    starts, fill = [0], 0
    for index, length in enumerate(lengths):
        if fill + length > capacity:
            starts.append(index)
            fill = 0
        fill += length
    starts.append(len(lengths))
    return np.asarray(starts[1:] if len(lengths) == 0 else starts, np.int64)


class PackedRows:
    """A random-access source over `examples` (instruction.InstructionRows) packed: row i as
    {"tokens", "counted", "segments", "positions"} of `examples.length` each."""

    def __init__(self, examples):
        self.examples, self.length, self.pad_id = examples, examples.length, examples.pad_id
        self.counts = examples.counts
        self.firsts = row_starts(np.diff(examples.starts), self.length)

    def __len__(self) -> int:
        return len(self.firsts) - 1

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, np.int64)
        shape = (len(indices), self.length)
        tokens = np.full(shape, self.pad_id, np.int32)
        counted = np.zeros(shape, np.uint8)
        segments = np.full(shape, PAD_SEGMENT, np.int32)
        positions = np.zeros(shape, np.int32)
        starts = self.examples.starts
        for row, index in enumerate(indices):
            fill = 0
            for segment, example in enumerate(range(self.firsts[index], self.firsts[index + 1])):
                start, end = starts[example], starts[example + 1]
                span = slice(fill, fill + end - start)
                tokens[row, span] = self.examples.tokens[start:end]
                counted[row, span] = self.examples.counted[start:end]
                segments[row, span] = segment + 1
                positions[row, span] = np.arange(end - start)
                fill += end - start
        return {"tokens": tokens, "counted": counted, "segments": segments, "positions": positions}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: rows[0] for name, rows in self.read_batch([index]).items()}

    def padding(self) -> tuple[float, float]:
        """(the share of padding tokens packed, the share one example per row would have)."""
        tokens = int(self.examples.starts[-1])
        examples = len(self.examples.starts) - 1
        packed = 1 - tokens / max(len(self) * self.length, 1)
        return packed, 1 - tokens / max(examples * self.length, 1)


def summary(name: str, train: PackedRows) -> str:
    """The log line of packing: rows formed and the padding saved."""
    packed, unpacked = train.padding()
    examples = len(train.examples)
    return (
        f"packing {name}: {examples} train examples in {len(train)} rows of {train.length} "
        f"tokens (greedy, in order): {packed:.1%} of the tokens are padding, {unpacked:.1%} "
        "with one example per row"
    )


@dataclasses.dataclass(frozen=True)
class DocumentWindows:
    """A transform: `windows`' inputs and targets of a stream of documents each ended by
    `eos_id`, with what keeps the documents apart: the inputs' `segment_ids` (1, 2, ... per
    document in the window; a new one starts after each `eos_id`) and `positions` (from 0 at
    each document's start and at the window's start), and a `loss_mask` that counts every target
    but those after an `eos_id` (the next document's first token, which the end of the last one
    cannot see)."""

    windows: NextCharacter
    eos_id: int

    def __call__(self, batch, keys=None) -> dict[str, np.ndarray]:
        out = self.windows(batch, keys)
        inputs = out["inputs"]
        starts = np.ones(inputs.shape, bool)
        starts[:, 1:] = inputs[:, :-1] == self.eos_id
        column = np.arange(inputs.shape[1], dtype=np.int32)
        first = np.maximum.accumulate(np.where(starts, column, 0), axis=1)
        return out | {
            SEGMENT_IDS: np.cumsum(starts, axis=1, dtype=np.int32),
            POSITIONS: column - first,
            LOSS_MASK: (inputs != self.eos_id).astype(np.float32),
        }


def document_summary(name: str, tokens, eos_id: int, seq_len: int) -> str:
    """The log line of packed documents: how many, their mean length, how they are kept apart."""
    documents = max(int(np.count_nonzero(np.asarray(tokens) == eos_id)), 1)
    return (
        f"packing {name}: {documents} train documents of {len(tokens) / documents:.1f} tokens "
        f"on average in windows of seq_len + 1 = {seq_len + 1} tokens, no padding; attention "
        "stays within each document (a new one starts after each end-of-document token) and "
        "positions restart at each document's start and at each window's"
    )
