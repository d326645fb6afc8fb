"""Own data named by the config: `npz:PATH`, `jsonl:PATH`, `parquet:PATH`, `hf:PATH`, or
`package.module:function`, resolved into train and eval splits and the roles of their columns.

The rules (docs/data.md says them to users):
- **Input and target.** `data.input_key` / `data.target_key` name them; unset, the target is the
  first column named one of `TARGET_NAMES`, and the input the first named one of `INPUT_NAMES`,
  else the one column left.
- **Kind.** A text (string) input trains a character-level language model: the rows' texts joined
  by newlines, tokenized by the sorted characters of train and eval (as dataset `text_file`),
  windows of `data.seq_len`. With `data.tokenizer`, each row is a document instead, packed by the
  tokenizer (tokenizer.py). Any other input is classification against an integer label per row;
  its classes are `data.num_classes`, else the largest label over both splits + 1 (at least what a
  `datasets` ClassLabel declares).
- **Eval split.** `data.eval_path` (a second file; a bare path takes the dataset's scheme), or
  `data.eval_fraction` (held-out rows: the first fraction of a permutation seeded with
  `HOLD_OUT_SEED`, so the same data gives the same split; for text, the last fraction of the
  characters; for tokenized text, the last fraction of the rows, or of the tokens of a single
  row), or the data's own validation / test / eval split (a DatasetDict, a function's dict).
- **Instruction data.** A `messages` column (or `prompt` and `completion`) makes each row one
  example of a language model whose loss counts the assistant's tokens (instruction.py); its
  held-out rows are drawn as classification's are.
  With none of these, one error line asks for one: a hold-out chosen silently would train on
  fewer rows than given.
"""

import dataclasses
import difflib
import os
import re

import numpy as np

from jddp.data import instruction, own_formats, tables, tokenizer
from jddp.errors import ConfigError, DataError, first_line
from jddp.runtime import user_code

FILE_SCHEMES = {
    "npz": own_formats.read_npz,
    "jsonl": own_formats.read_jsonl,
    "parquet": own_formats.read_parquet,
    "hf": own_formats.read_hf,
}
FUNCTION = "function"
TARGET_NAMES = ("label", "labels", "target", "targets", "y")
INPUT_NAMES = ("image", "inputs", "input", "features", "x", "text")
EVAL_SPLITS = ("validation", "test", "eval")  # in this order, when the data has several
HOLD_OUT_SEED = 0
_FUNCTION_NAME = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_ALL_FORMS = "npz:PATH, jsonl:PATH, parquet:PATH, hf:PATH or package.module:function"


def is_own_data(name: str) -> bool:
    """Whether `name` names own data (a scheme or a function) rather than a built-in dataset."""
    return ":" in name


@dataclasses.dataclass(frozen=True)
class DataName:
    """A parsed `scheme:PATH` or `package.module:function`."""

    scheme: str  # one of FILE_SCHEMES, or FUNCTION
    target: str  # the path (user-expanded), or "package.module:function"
    text: str  # as written, for messages


def parse_name(text: str, key: str = "dataset", default_scheme: str = "") -> DataName:
    """`text` as a DataName; `default_scheme` is taken by a bare path (data.eval_path)."""
    scheme, sep, rest = text.partition(":")
    if sep and scheme in FILE_SCHEMES:
        if not rest:
            raise ConfigError(f"{key} {text!r} names no file; write {scheme}:PATH")
        return DataName(scheme, os.path.expanduser(rest), text)
    if _FUNCTION_NAME.fullmatch(text):
        return DataName(FUNCTION, text, text)
    if default_scheme and default_scheme != FUNCTION:
        return DataName(default_scheme, os.path.expanduser(text), f"{default_scheme}:{text}")
    if sep and re.fullmatch(r"\w+", scheme):
        close = difflib.get_close_matches(scheme, FILE_SCHEMES, n=1)
        hint = f" (did you mean {close[0]}:?)" if close else ""
        raise ConfigError(
            f"{key} {text!r} has the unknown scheme {scheme!r}{hint}; write {_ALL_FORMS}"
        )
    raise ConfigError(f"{key} {text!r} is not a data name; write {_ALL_FORMS}")


def read_splits(name: DataName) -> dict[str, tables.Table]:
    """The splits `name` holds: {"train": ...} for a file, every split of a DatasetDict or of a
    function's dict of splits."""
    if name.scheme != FUNCTION:
        return FILE_SCHEMES[name.scheme](name.target, name.text)
    function = user_code.load(
        name.target, f"dataset {name.text!r}", hint=f", or write {_ALL_FORMS}", failure=DataError
    )
    if not callable(function):
        raise ConfigError(f"dataset {name.text!r}: {name.target!r} is not a function")
    try:
        returned = function()
    except Exception as e:  # the user's function failed: its own error, in one line
        raise DataError(
            f"dataset function {name.text} failed: {type(e).__name__}: {first_line(e)}"
        ) from None
    return own_formats.from_returned(returned, name.text)


@dataclasses.dataclass(frozen=True)
class OwnData:
    """Own data resolved: its kind, columns and splits (tables; for a language model texts, or
    with data.tokenizer lists of documents)."""

    name: str
    language_model: bool
    num_classes: int  # classification only; a language model's come from its vocabulary
    input_key: str  # the input column
    target_key: str  # the label column ("" for text)
    train: object  # a tables.Table, or the training text (documents)
    eval: object  # a tables.Table, or the eval text (documents; None: see eval_fraction)
    train_where: str = ""
    eval_where: str = ""
    vocabulary: str = ""  # a character-level language model's characters, by code point
    eval_fraction: float = 0.0  # one tokenized document: its last fraction of tokens is eval
    instruction: tuple[str, ...] = ()  # instruction data: its columns (instruction.py)


@dataclasses.dataclass(frozen=True)
class OwnColumns:
    """Own classification data's transform: the input column as float32 (floats, booleans) or
    int32 (integers: token ids, or pixels the model scales itself), the labels as int32 `label`,
    which jddp's classification loss reads. No augmentation."""

    input_key: str
    target_key: str

    def __call__(self, batch, keys=None) -> dict[str, np.ndarray]:
        inputs = np.asarray(batch[self.input_key])
        dtype = np.int32 if inputs.dtype.kind in "iu" else np.float32
        labels = np.asarray(batch[self.target_key], np.int32)
        return {self.input_key: inputs.astype(dtype), "label": labels}


def check_eval_options(options, own_data: bool, dataset: str) -> None:
    """One line for eval options that cannot hold, checked before any file is read."""
    fraction, path = options.eval_fraction, options.eval_path
    if not isinstance(fraction, int | float) or isinstance(fraction, bool) or not 0 <= fraction < 1:
        raise ConfigError(
            f"data.eval_fraction must be in [0, 1), got {fraction!r}; set e.g. "
            "--config.data.eval_fraction=0.1 (0: no held-out rows)"
        )
    if path and fraction:
        raise ConfigError(
            "data.eval_path and data.eval_fraction are both set; evaluate on the file or on "
            "held-out rows, not both (clear one)"
        )
    own_keys = [
        f"data.{key}"
        for key in ("eval_path", "eval_fraction", "input_key", "target_key", "num_classes")
        if getattr(options, key)
    ]
    if own_keys and not own_data:
        verb = "applies" if len(own_keys) == 1 else "apply"
        raise ConfigError(
            f"{', '.join(own_keys)} {verb} to own data ({_ALL_FORMS}); dataset {dataset!r} is "
            "built in, with its own splits and columns: clear it or name own data"
        )
    if not isinstance(options.num_classes, int) or options.num_classes < 0:
        raise ConfigError(
            f"data.num_classes must be an integer >= 0 (0: from the labels), got "
            f"{options.num_classes!r}"
        )


def resolve(text: str, options) -> OwnData:
    """The own data `text` names (see the module doc), checked; `options` are DataOptions."""
    check_eval_options(options, True, text)
    name = parse_name(text)
    splits = read_splits(name)
    train_split = _train_split(splits, name)
    train = splits[train_split]
    columns = instruction.instruction_columns(train, options)
    if columns:
        eval_table, eval_name = _given_eval(splits, train_split, name, options)
        return _instruction_data(text, train, eval_table, eval_name, columns, options)
    input_key, target_key, text_input = _roles(train, options)
    eval_table, eval_name = _given_eval(splits, train_split, name, options)
    if eval_table is not None:
        _check_eval_columns(eval_table, train, input_key, target_key)
    if text_input:
        return _text_data(text, train, eval_table, input_key, options)
    if eval_table is None:  # held-out rows
        train, eval_table = _held_out_rows(train, options.eval_fraction)
        eval_name = f"{options.eval_fraction:g} of the rows of {train.where} held out"
    used = [input_key, target_key]
    train, eval_table = train.select(used), eval_table.select(used)
    num_classes = _num_classes(train, eval_table, target_key, options.num_classes)
    return OwnData(
        text, False, num_classes, input_key, target_key, train, eval_table,
        train_where=train.where, eval_where=eval_name,
    )  # fmt: skip


def _train_split(splits: dict, name: DataName) -> str:
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return next(iter(splits))
    raise DataError(
        f"{name.text} has the splits {', '.join(splits)} and none is named 'train'; name the "
        "training split 'train'"
    )


def _given_eval(splits: dict, train_split: str, name: DataName, options):
    """The eval table from data.eval_path or the data's own eval split; (None, "") when the
    rows are to be held out (data.eval_fraction); else one line asking for an eval split."""
    if options.eval_path:
        eval_name = parse_name(options.eval_path, "data.eval_path", default_scheme=name.scheme)
        given = read_splits(eval_name)
        own = [s for s in EVAL_SPLITS if s in given]
        split = own[0] if own else ("train" if "train" in given else next(iter(given)))
        return given[split], given[split].where
    if options.eval_fraction:
        return None, ""
    for split in EVAL_SPLITS:
        if split in splits and split != train_split:
            return splits[split], splits[split].where
    raise ConfigError(
        f"{name.text} has no eval split; set --config.data.eval_path=PATH (a second file) or "
        "--config.data.eval_fraction=0.1 (held-out rows)"
    )


def _roles(table: tables.Table, options) -> tuple[str, str, bool]:
    """(input column, target column, whether the input is text) of `table`."""
    columns = table.columns
    listed = ", ".join(columns)
    for key in ("input_key", "target_key"):
        chosen = getattr(options, key)
        if chosen and chosen not in columns:
            raise ConfigError(
                f"data.{key} {chosen!r} is not a column of {table.where}; its columns: {listed}"
            )
    target = options.target_key or next((c for c in TARGET_NAMES if c in columns), "")
    input_key = options.input_key or next(
        (c for c in INPUT_NAMES if c in columns and c != target), ""
    )
    others = [c for c in columns if c != target]
    if not input_key and len(others) == 1:
        input_key = others[0]
    if not input_key:
        raise ConfigError(
            f"cannot tell which column of {table.where} is the model input (columns: {listed}); "
            "set --config.data.input_key"
        )
    text_input = tables.is_text(table.read_batch([0])[input_key])
    if text_input:
        if options.target_key:
            raise ConfigError(
                f"the input {input_key!r} is text, which trains a language model (the target "
                "is the next token); clear data.target_key"
            )
        return input_key, "", True
    if not target:
        raise ConfigError(
            f"{table.where} has no label column (columns: {listed}; looked for "
            f"{', '.join(TARGET_NAMES)}); set --config.data.target_key"
        )
    if target == input_key or input_key == "label":
        raise ConfigError(
            f"data.input_key {input_key!r} and the labels {target!r} must be two columns, and "
            "the input cannot be named 'label'; set --config.data.input_key/target_key"
        )
    return input_key, target, False


def _check_eval_columns(eval_table, train, input_key: str, target_key: str) -> None:
    needed = [key for key in (input_key, target_key) if key]
    missing = [key for key in needed if key not in eval_table.columns]
    if missing:
        raise DataError(
            f"the eval data {eval_table.where} lacks the column {missing[0]!r} (its columns: "
            f"{', '.join(eval_table.columns)})"
        )
    train_row, eval_row = (t.select(needed).read_batch([0]) for t in (train, eval_table))
    for key in needed:
        shapes = (np.shape(train_row[key])[1:], np.shape(eval_row[key])[1:])
        if shapes[0] != shapes[1]:
            raise DataError(
                f"column {key!r} has shape {shapes[1]} per row in {eval_table.where} but "
                f"{shapes[0]} in {train.where}; both splits need the same shape"
            )


def _held_out_rows(table: tables.Table, fraction: float):
    """(train rows, eval rows): the eval rows are the first `fraction` of a permutation seeded
    with HOLD_OUT_SEED; both keep file order."""
    count = len(table)
    held = max(1, round(count * fraction))
    if held >= count:
        raise DataError(
            f"{table.where} has {count} rows: holding out {fraction:g} of them leaves none to "
            "train on; use a smaller data.eval_fraction or more rows"
        )
    order = np.random.default_rng(HOLD_OUT_SEED).permutation(count)
    return tables.Rows(table, np.sort(order[held:])), tables.Rows(table, np.sort(order[:held]))


def _num_classes(train, eval_table, target_key: str, given: int) -> int:
    largest, declared = -1, 0
    for table in (train, eval_table):
        labels = table.column(target_key)
        if labels.ndim != 1:
            raise DataError(
                f"labels {target_key!r} of {table.where} have shape {labels.shape[1:]} per row; "
                "classification takes one integer class per row"
            )
        if labels.dtype.kind not in "iu":
            raise DataError(
                f"labels {target_key!r} of {table.where} are {labels.dtype}, not integers; "
                "store class indices 0..C-1 (e.g. labels.astype(np.int64))"
            )
        if labels.min() < 0:
            raise DataError(
                f"labels {target_key!r} of {table.where} include {labels.min()}; classes are "
                "0..C-1 (drop unlabelled rows)"
            )
        largest = max(largest, int(labels.max()))
        declared = max(declared, table.declared_classes(target_key) or 0)
    if given and largest >= given:
        raise DataError(
            f"label {largest} is out of range for data.num_classes={given} (classes 0.."
            f"{given - 1}); raise data.num_classes or set it to 0 (from the labels)"
        )
    return given or max(declared, largest + 1)


def _text_data(text, train, eval_table, input_key: str, options) -> OwnData:
    """A language model's train and eval texts: rows joined by newlines (with data.tokenizer:
    each row a document)."""
    if options.tokenizer:
        return _documents(text, train, eval_table, input_key, options)
    train_text = "\n".join(str(t) for t in train.column(input_key))
    if eval_table is None:  # the last eval_fraction of the characters (as dataset text_file)
        cut = int(len(train_text) * (1 - options.eval_fraction))
        train_text, eval_text = train_text[:cut], train_text[cut:]
        eval_where = f"the last {options.eval_fraction:g} of the text of {train.where}"
        train_where = f"the first {1 - options.eval_fraction:g} of the text of {train.where}"
    else:
        eval_text = "\n".join(str(t) for t in eval_table.column(input_key))
        train_where, eval_where = train.where, eval_table.where
    vocabulary = "".join(sorted(set(train_text) | set(eval_text)))
    if len(vocabulary) < 2:
        raise DataError(
            f"the text {input_key!r} of {train.where} has fewer than 2 distinct characters"
        )
    return OwnData(
        text, True, len(vocabulary), input_key, "", train_text, eval_text,
        train_where=train_where, eval_where=eval_where, vocabulary=vocabulary,
    )  # fmt: skip


def _instruction_data(text, train, eval_table, eval_name, columns, options) -> OwnData:
    """Instruction rows (the `columns` of each split), an eval split held out as rows if none is
    given."""
    for key in ("target_key", "num_classes"):
        if getattr(options, key):
            raise ConfigError(
                f"data.{key} does not apply to instruction data ({', '.join(columns)} columns of "
                f"{train.where}: a language model's); clear it"
            )
    if eval_table is None:
        train, eval_table = _held_out_rows(train, options.eval_fraction)
        eval_name = f"{options.eval_fraction:g} of the rows of {train.where} held out"
    else:
        first, second = (*columns, "")[:2]
        _check_eval_columns(eval_table, train, first, second)
    train, eval_table = train.select(columns), eval_table.select(columns)
    return OwnData(
        text, True, 0, columns[0], "", train, eval_table, train_where=train.where,
        eval_where=eval_name, instruction=tuple(columns),
    )  # fmt: skip


def _documents(text, train, eval_table, input_key: str, options) -> OwnData:
    """A tokenized language model's train and eval documents, one per row. Held out by
    eval_fraction: the last fraction of the rows, or of the tokens of a single row (cut when the
    data is opened and tokenized)."""
    documents = [str(t) for t in train.column(input_key)]
    fraction, eval_fraction = options.eval_fraction, 0.0
    if eval_table is not None:
        eval_documents = [str(t) for t in eval_table.column(input_key)]
        train_where, eval_where = train.where, eval_table.where
    elif len(documents) > 1:
        held = tokenizer.held_out_documents(len(documents), fraction, train.where)
        documents, eval_documents = documents[:-held], documents[-held:]
        train_where = f"the first {len(documents)} rows of {train.where}"
        eval_where = f"the last {held} rows ({fraction:g}) of {train.where}"
    else:
        eval_documents, eval_fraction = None, fraction
        train_where = f"the first {1 - fraction:g} of the tokens of {train.where}"
        eval_where = f"the last {fraction:g} of the tokens of {train.where}"
    return OwnData(
        text, True, 0, input_key, "", documents, eval_documents,
        train_where=train_where, eval_where=eval_where, eval_fraction=eval_fraction,
    )  # fmt: skip
