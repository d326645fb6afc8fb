"""Instruction data: rows of chat `messages` or of `prompt` / `completion`, each row one example
whose loss counts only the assistant's (the completion's) tokens, with `data.loss_on=completion`
(the default for such data), or every token of the row with `all`.

The formats, as TRL's SFTTrainer reads them:
- `messages` (a list of {role, content} per row; `data.input_key` may name another column):
  rendered by the tokenizer's chat template (chat_template.py) and tokenized without adding
  special tokens, which gives the ids of transformers' `apply_chat_template(messages)`. Counted:
  the assistant's turns.
- `prompt` and `completion` strings: the text prompt + completion, with the end-of-document token
  appended where the completion does not end with it, tokenized with the tokenizer's own special
  tokens (a BOS first). No chat template. Counted: the completion.
- `prompt` and `completion` lists of messages: the chat template over prompt + completion.
  Counted: everything after the prompt rendered with the generation prompt.

A token counts where its characters overlap a counted span (transformers' rule for its assistant
mask). Each row is one example of up to seq_len + 1 tokens (inputs and targets shifted by one):
a longer row is cut at its end, keeping its start (TRL's default), and the log line counts the
rows cut; a shorter one is padded, and padding never counts. A row left with no counted target is
refused in one line (nothing in it would be learned): no assistant turn, or a prompt that fills
seq_len.
"""

import dataclasses
from collections.abc import Mapping

import numpy as np

from jddp.data.chat_template import ChatTemplate, RenderError
from jddp.errors import ConfigError, DataError
from jddp.losses import LOSS_MASK

MESSAGES, PROMPT, COMPLETION = "messages", "prompt", "completion"
LOSS_ON = ("completion", "all")  # data.loss_on; "" = completion
_CHUNK = 1024  # rows rendered and encoded at a time
SEGMENT_IDS, POSITIONS = "segment_ids", "positions"  # packed batches' entries
# A decoder's inputs from a packed batch (jddp.core.modules.ModelInputs)
PACKED_INPUTS = {"tokens": "inputs", SEGMENT_IDS: SEGMENT_IDS, POSITIONS: POSITIONS}


def check_loss_on(value) -> None:
    """A ConfigError unless `value` is a data.loss_on."""
    if value not in ("", *LOSS_ON):
        raise ConfigError(
            f"data.loss_on must be completion or all, got {value!r}; set "
            "--config.data.loss_on=completion (only the assistant's / completion's tokens) or all"
        )


def instruction_columns(table, options) -> tuple[str, ...]:
    """The columns that make `table` instruction data: (the messages column,) or (prompt,
    completion); () if it is other data."""
    key = options.input_key or MESSAGES
    if key in table.columns:
        first = table.select([key]).read_batch([0])[key][0]
        if _is_message_list(first):
            return (key,)
        if key == MESSAGES:
            raise DataError(
                f"column {MESSAGES!r} of {table.where} holds {type(first).__name__} values, not "
                "lists of {role, content} messages; write each row's conversation as "
                '[{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]'
            )
    if not options.input_key and PROMPT in table.columns and COMPLETION in table.columns:
        return (PROMPT, COMPLETION)
    return ()


def needs_template(table, columns: tuple[str, ...]) -> bool:
    """Whether the rows are rendered by a chat template (messages, not prompt/completion text)."""
    if len(columns) == 1:
        return True
    return not isinstance(table.select([PROMPT]).read_batch([0])[PROMPT][0], str)


def _is_message_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, Mapping) for m in value)


@dataclasses.dataclass(frozen=True)
class Counts:
    """What tokenizing a split found: rows, rows cut, target tokens kept and those counted."""

    rows: int
    cut: int
    targets: int
    counted: int


class InstructionRows:
    """A random-access source: row i as {"tokens", "counted"} of `length` (seq_len + 1) each,
    padded with `pad_id` (never counted). The rows' tokens are held end to end, unpadded."""

    def __init__(self, tokens, counted, starts, length: int, pad_id: int, counts: Counts):
        self.tokens, self.counted, self.starts = tokens, counted, starts
        self.length, self.pad_id, self.counts = length, pad_id, counts

    def __len__(self) -> int:
        return len(self.starts) - 1

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, np.int64)
        tokens = np.full((len(indices), self.length), self.pad_id, np.int32)
        counted = np.zeros((len(indices), self.length), np.uint8)
        for row, index in enumerate(indices):
            start, end = self.starts[index], self.starts[index + 1]
            tokens[row, : end - start] = self.tokens[start:end]
            counted[row, : end - start] = self.counted[start:end]
        return {"tokens": tokens, "counted": counted}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: rows[0] for name, rows in self.read_batch([index]).items()}


@dataclasses.dataclass(frozen=True)
class MaskedNextTokens:
    """Rows of tokens to `inputs`, `targets` (shifted by one) and the targets' `loss_mask`
    (1.0 where a target counts). Packed rows (packing.py) also give the inputs' `segment_ids`
    and `positions`, and no target counts that starts another example."""

    def __call__(self, batch, keys=None) -> dict[str, np.ndarray]:
        tokens = np.asarray(batch["tokens"], np.int32)
        counted = np.asarray(batch["counted"], np.float32)
        out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], LOSS_MASK: counted[:, 1:]}
        if "segments" in batch:
            segments = np.asarray(batch["segments"], np.int32)
            out[LOSS_MASK] = out[LOSS_MASK] * (segments[:, 1:] == segments[:, :-1])
            out[SEGMENT_IDS], out[POSITIONS] = segments[:, :-1], batch["positions"][:, :-1]
        return out


def tokenize(
    table, columns, tokenizer, template: ChatTemplate | None, seq_len: int, loss_on: str
) -> InstructionRows:
    """`table`'s rows (the `columns` instruction_columns found) as InstructionRows of seq_len + 1
    tokens; a DataError in one line for a row that is malformed, that the template refuses, or
    that keeps no counted target."""
    length, everything = seq_len + 1, loss_on == "all"
    encoder = tokenizer.untruncated()
    values = {name: table.column(name) for name in columns}
    chat = template is not None
    tokens, counted, cut, targets = [], [], 0, 0
    for first in range(0, len(table), _CHUNK):
        rows = range(first, min(first + _CHUNK, len(table)))
        texts, spans = [], []
        for index in rows:
            row = {name: values[name][index] for name in columns}
            try:
                text, row_spans = _render(row, template, everything, tokenizer.eos_token)
            except _RowError as e:
                raise DataError(f"row {index} of {table.where}: {e}") from None
            if not everything and not row_spans:
                raise DataError(
                    f"row {index} of {table.where} has no assistant turn: nothing in it would be "
                    "learned with data.loss_on=completion; add the assistant's answer, drop the "
                    "row, or set data.loss_on=all"
                )
            texts.append(text)
            spans.append(row_spans)
        # Chat templates write their special tokens themselves (transformers encodes the
        # rendered chat without adding any); plain prompt + completion gets the tokenizer's own.
        for index, encoding, row_spans in zip(
            rows, encoder.encode_batch(texts, add_special_tokens=not chat), spans, strict=True
        ):
            ids = np.asarray(encoding.ids, np.int32)
            mask = _mask(np.asarray(encoding.offsets).reshape(-1, 2), row_spans, everything)
            longer = len(ids) > length
            if longer:
                cut += 1
                ids, mask = ids[:length], mask[:length]
            if not mask[1:].any():  # the first token is no target
                why = (
                    f"its prompt fills the first {seq_len} tokens; raise data.seq_len, shorten "
                    "the prompt or drop the row"
                    if longer
                    else "its counted part is empty; give it an answer or drop the row"
                )
                raise DataError(
                    f"row {index} of {table.where} has nothing counted within data.seq_len="
                    f"{seq_len}: {why}"
                )
            tokens.append(ids)
            counted.append(mask)
            targets += len(ids) - 1
    starts = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64)
    counts = Counts(len(tokens), cut, targets, int(sum(int(m[1:].sum()) for m in counted)))
    return InstructionRows(
        np.concatenate(tokens), np.concatenate(counted), starts, length, tokenizer.eos_id, counts
    )


def _render(row: dict, template, everything: bool, eos_token: str):
    """(the row's text, the character spans that count; None: every token counts)."""
    if len(row) == 1:  # messages
        (messages,) = row.values()
        _check_messages(messages)
        text = _rendered(template, messages)
        return text, None if everything else _spans(template.assistant_spans, messages, text)
    prompt, completion = row[PROMPT], row[COMPLETION]
    if isinstance(prompt, str) and isinstance(completion, str) and template is None:
        if not completion.endswith(eos_token):  # as TRL: the model learns to stop
            completion += eos_token
        text = prompt + completion
        return text, None if everything else [(len(prompt), len(text))]
    if template is None or not (_is_message_list(prompt) and _is_message_list(completion)):
        raise _RowError(
            f"its prompt is a {type(prompt).__name__} and its completion a "
            f"{type(completion).__name__}; every row needs both as strings, or both as lists of "
            "{role, content} messages, as the first row has"
        )
    _check_messages(prompt + completion)
    text = _rendered(template, prompt + completion)
    if everything:
        return text, None
    return text, [_spans(template.completion_span, prompt, prompt + completion, text)]


def _rendered(template: ChatTemplate, messages) -> str:
    try:
        return template.render(messages)
    except RenderError as e:
        raise _RowError(f"the chat template of {template.where} refuses it: {e}") from None


def _spans(find, *args):
    try:
        return find(*args)
    except RenderError as e:
        raise _RowError(str(e)) from None


class _RowError(Exception):
    """A row's problem in one line, without the row (tokenize names it)."""


def _check_messages(messages) -> None:
    if not _is_message_list(messages) or not messages:
        raise _RowError("it is not a list of {role, content} messages")
    for number, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or content is None:
            raise _RowError(
                f"message {number} has no {'role' if not isinstance(role, str) else 'content'}; "
                'every message needs both, e.g. {"role": "user", "content": "Hi"}'
            )


def _mask(offsets: np.ndarray, spans, everything: bool) -> np.ndarray:
    """uint8 per token: 1 where its characters overlap one of `spans` (all, if everything)."""
    if everything:
        return np.ones(len(offsets), np.uint8)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), bool)
    for start, end in spans:
        mask |= (ends > start) & (starts < end)
    return mask.astype(np.uint8)


def summary(name: str, columns, train: InstructionRows, test: InstructionRows, loss_on: str):
    """The log line of instruction data: rows, rows cut, the share of tokens the loss counts."""
    kind = "messages" if len(columns) == 1 else "prompt/completion"
    counted = "every token" if loss_on == "all" else "the assistant's / completion's tokens"
    counts = train.counts
    share = counts.counted / max(counts.targets, 1)
    return (
        f"instruction data {name} ({kind}): train {counts.rows} rows ({counts.cut} cut at the end "
        f"to seq_len + 1 = {train.length} tokens), eval {test.counts.rows} rows "
        f"({test.counts.cut} cut); the loss counts {counted}: {counts.counted} of the "
        f"{counts.targets} train target tokens ({share:.1%})"
    )
