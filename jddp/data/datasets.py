"""Datasets by the name a config's `dataset` gives them: what each one is, and opening its splits.

`get_dataset(name)` answers what a model and a loss need before any data is read (the kind of
task, the number of classes or the vocabulary); `open_dataset(spec, options)` prepares the TFDS
dataset on first use (array_record files, no TensorFlow) and returns its random-access splits
with the dataset's preprocessing. Own data (`npz:PATH`, `jsonl:PATH`, `parquet:PATH`, `hf:PATH`,
`package.module:function`) is resolved by jddp/data/user_data.py: its spec reads the labels (or
the text) already, to count the classes (or the characters). With `data.tokenizer`, text is
tokenized by a Hugging Face tokenizer (jddp/data/tokenizer.py) instead of by characters, and
instruction data (chat `messages`, `prompt` / `completion`) is rendered by its chat template and
tokenized a row per example, with a loss mask (jddp/data/instruction.py). With `data.packing`,
instruction examples share rows and documents share windows, kept apart (jddp/data/packing.py).
"""

import contextlib
import dataclasses
import difflib
import errno
import fcntl
import functools
import os
from collections.abc import Callable

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from jddp.data import instruction, packing, text, token_file, transforms, user_data
from jddp.data import tokenizer as tokenizer_lib
from jddp.data.cache import decoded_split, is_decoded
from jddp.data.chat_template import ChatTemplate, load_chat_template
from jddp.data.cifar import Cifar10, Cifar100
from jddp.data.digits import UciDigits
from jddp.data.imagenet import Imagenet2012
from jddp.data.loader import Transform, read_batch
from jddp.data.mnist import FashionMnist, Mnist
from jddp.data.shakespeare import VOCABULARY, ShakespeareChar
from jddp.data.source_files import LocalFilesBuilder
from jddp.errors import ConfigError, DataError, UsageError
from jddp.runtime.fs import directory_problem
from jddp.runtime.quiet import library_warnings_muted

CLASSIFICATION, LANGUAGE_MODEL = "classification", "language_model"


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """Where data lives and how it is read and preprocessed: the `data.*` config keys."""

    data_dir: str = ""  # TFDS data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    manual_dir: str = ""  # local source files; "" = <data_dir>/downloads/manual
    text_file: str = ""  # dataset text_file: the UTF-8 file to model
    tokenizer: str = ""  # text: a Hugging Face tokenizer.json (or its directory); "" = characters
    eos_token: str = ""  # with tokenizer: the end-of-document token; "" = found (tokenizer.py)
    seq_len: int = 256  # language models: tokens per example
    image_size: int = 224  # ImageNet: side of the square crops
    augment: bool = True  # random crops and flips in training, where the dataset defines them
    cache_max_mb: float = 256.0  # splits up to this size on disk are decoded once to numpy
    # Own data (npz:, jsonl:, parquet:, hf:, package.module:function), see user_data.py.
    input_key: str = ""  # the input column; "" = image, inputs, input, features, x, text, the one
    target_key: str = ""  # the label column; "" = label, labels, target, targets or y
    num_classes: int = 0  # 0 = the largest label + 1
    eval_path: str = ""  # the eval split's file (a bare path takes the dataset's scheme)
    eval_fraction: float = 0.0  # or this fraction of the rows held out (0: none)
    # Instruction data: the tokens the loss counts, completion (the assistant's) | all; "" =
    # completion for instruction data (plain text counts every token).
    loss_on: str = ""
    # Several examples per row of seq_len + 1 tokens (instruction data), or documents kept apart
    # in their windows (text tokenized by data.tokenizer), attention kept within each
    # (packing.py); false: one example per row, padded, and windows that run across documents.
    packing: bool = False
    threads: int = 1  # loader threads
    workers: int = 0  # loader processes (0: none, the threads of this process load)
    device_prefetch: int = 2  # batches placed on the devices ahead of the step

    @classmethod
    def from_config(cls, data_config) -> "DataOptions":
        names = [field.name for field in dataclasses.fields(cls)]
        return cls(**{name: data_config[name] for name in names if name in data_config})

    @property
    def resolved_data_dir(self) -> str:
        return (
            self.data_dir
            or os.environ.get("TFDS_DATA_DIR")
            or os.path.expanduser("~/tensorflow_datasets")
        )

    @property
    def resolved_manual_dir(self) -> str:
        return self.manual_dir or os.path.join(self.resolved_data_dir, "downloads", "manual")


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a dataset is: enough to build a model and choose a loss before reading any data."""

    name: str
    kind: str  # CLASSIFICATION or LANGUAGE_MODEL
    num_classes: int  # classes; for a language model, the vocabulary size
    builder_class: type[tfds.core.DatasetBuilder] | None  # None: a local text file
    make_transform: Callable[[DataOptions], Transform]
    input_key: str = "image"  # the model input
    target_key: str = "label"  # what the loss compares the outputs with
    vocabulary: str = ""  # character-level language models: token i is vocabulary[i]
    train_split: str = "train"
    eval_split: str = "test"
    text_file: str = ""
    # Own data: its splits and columns, resolved when the spec is made (user_data.py).
    own: user_data.OwnData | None = dataclasses.field(default=None, compare=False, repr=False)
    tokenizer: tokenizer_lib.TextTokenizer | None = None  # data.tokenizer; None: characters
    loss_mask: bool = False  # instruction data, packing: batches say which targets count
    chat_template: ChatTemplate | None = dataclasses.field(default=None, compare=False, repr=False)
    packed: bool = False  # data.packing: batches carry segment_ids and positions

    @property
    def model_inputs(self):
        """The model's `input_key`: `input_key`, or a decoder's three entries when packed."""
        return dict(instruction.PACKED_INPUTS) if self.packed else self.input_key

    def decode(self, tokens) -> str:
        """A language model's token ids back to text: by the tokenizer, else the vocabulary."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(tokens)
        return text.decode(tokens, self.vocabulary)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset's random-access splits, and the preprocessing they go through."""

    spec: DatasetSpec
    train: object
    eval: object
    transform: Transform

    def sample_batch(self) -> dict[str, np.ndarray]:
        """One preprocessed eval example, as a batch of 1 (to shape a model)."""
        return self.transform(read_batch(self.eval, np.array([0])))


def _scale(options: DataOptions) -> Transform:
    return transforms.ScaleImages()


def _cifar(options: DataOptions) -> Transform:
    mean, std = transforms.CIFAR_MEAN, transforms.CIFAR_STD
    return transforms.StandardizeImages(mean, std, options.augment)


def _imagenet(options: DataOptions) -> Transform:
    return transforms.ImagenetImages(options.image_size, options.augment)


def _next_character(options: DataOptions) -> Transform:
    return transforms.NextCharacter(options.seq_len, options.augment)


def _language_model_spec(name, builder_class, vocabulary="") -> DatasetSpec:
    return DatasetSpec(
        name, LANGUAGE_MODEL, len(vocabulary), builder_class, _next_character,
        input_key="inputs", target_key="targets", vocabulary=vocabulary,
    )  # fmt: skip


DATASETS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec("digits", CLASSIFICATION, 10, UciDigits, _scale),
    "mnist": DatasetSpec("mnist", CLASSIFICATION, 10, Mnist, _scale),
    "fashion_mnist": DatasetSpec("fashion_mnist", CLASSIFICATION, 10, FashionMnist, _scale),
    "cifar10": DatasetSpec("cifar10", CLASSIFICATION, 10, Cifar10, _cifar),
    "cifar100": DatasetSpec("cifar100", CLASSIFICATION, 100, Cifar100, _cifar),
    "imagenet2012": DatasetSpec(
        "imagenet2012", CLASSIFICATION, 1000, Imagenet2012, _imagenet, eval_split="validation"
    ),
    "shakespeare_char": _language_model_spec("shakespeare_char", ShakespeareChar, VOCABULARY),
    "text_file": _language_model_spec("text_file", None),  # vocabulary: the file's characters
}


def get_dataset(name: str, text_file: str = "", *, options: DataOptions | None = None):
    """The dataset `name`: a built-in one or own data (`npz:PATH`, ...: read here for its
    classes or vocabulary, with the columns and eval split `options` give); `text_file` (or
    `options.text_file`) is the file of dataset `text_file` (read here for its vocabulary). With
    `options.tokenizer`, a text dataset's vocabulary is that tokenizer's (loaded here)."""
    options = options or DataOptions()
    text_file = text_file or options.text_file
    own_data = user_data.is_own_data(name)
    user_data.check_eval_options(options, own_data, name)
    instruction.check_loss_on(options.loss_on)
    if text_file and name != "text_file":
        raise ConfigError(
            f"data.text_file is set but dataset is {name!r}; set --config.dataset=text_file "
            "to train on the file, or clear --config.data.text_file"
        )
    if options.eos_token and not options.tokenizer:
        raise ConfigError(
            "data.eos_token applies with data.tokenizer (a Hugging Face tokenizer.json); set "
            "--config.data.tokenizer=PATH or clear data.eos_token"
        )
    if options.tokenizer and name in DATASETS and DATASETS[name].kind != LANGUAGE_MODEL:
        raise ConfigError(_tokenizer_needs_text(f"dataset {name!r}"))
    tokenizer = None
    if options.tokenizer and (own_data or name in DATASETS):
        tokenizer = tokenizer_lib.load_tokenizer(options.tokenizer, options.eos_token)
    if own_data:
        own = user_data.resolve(name, options)
        if own.instruction:
            return _instruction_spec(own, tokenizer, options)
        _check_no_completion(options, name)
        if tokenizer is not None and not own.language_model:
            where = f"the input {own.input_key!r} of {name} (not text)"
            raise ConfigError(_tokenizer_needs_text(where, own=True))
        return _packed_documents(_own_dataset_spec(own, tokenizer), options)
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3, cutoff=0.5)
        hint = f" (close: {', '.join(close)})" if close else ""
        scheme = {".npz": "npz", ".jsonl": "jsonl", ".parquet": "parquet"}
        extension = os.path.splitext(name)[1]
        if extension in scheme:  # a path without its scheme
            hint = f" (did you mean {scheme[extension]}:{name}?)"
        raise ConfigError(
            f"unknown dataset {name!r}{hint}; choose one of {', '.join(sorted(DATASETS))}, or "
            "own data: npz:PATH, jsonl:PATH, parquet:PATH, hf:PATH, package.module:function"
        )
    _check_no_completion(options, name)
    spec = DATASETS[name]
    _check_packable(spec, options)  # before a text file is read
    if name == "text_file":
        vocabulary = text.scan_text_file(text_file).vocabulary
        spec = dataclasses.replace(
            spec, num_classes=len(vocabulary), vocabulary=vocabulary, text_file=text_file
        )
    spec = _tokenized_spec(spec, tokenizer) if tokenizer is not None else spec
    return _packed_documents(spec, options)


def _check_no_completion(options: DataOptions, name: str) -> None:
    if options.loss_on == "completion":
        raise ConfigError(
            f"data.loss_on=completion applies to instruction data (a messages column, or prompt "
            f"and completion); dataset {name!r} has no completion, and its loss counts every "
            "token: clear data.loss_on"
        )


def _check_packable(spec: DatasetSpec, options: DataOptions) -> None:
    """With data.packing, one line unless `spec`'s data has documents to keep apart (instruction
    data's examples are checked where they are read)."""
    if not options.packing:
        return
    if spec.kind != LANGUAGE_MODEL:
        why = (
            "is not text: packing keeps apart instruction examples (a messages column, or prompt "
            "and completion) or documents (text tokenized by data.tokenizer)"
        )
    elif spec.own is None and spec.builder_class is None:
        why = (
            "is one text file, a single document with no boundaries to keep apart; write one "
            "document per row of a jsonl:, parquet: or hf: dataset"
        )
    elif not options.tokenizer:
        why = (
            "is character-level text, one stream with no document boundaries; set "
            "data.tokenizer (each row, or each work, is then a document)"
        )
    elif spec.own is not None and len(spec.own.train) < 2:
        why = (
            "has a single row of text, one document with no boundaries to keep apart; give one "
            "document per row"
        )
    else:
        return
    raise ConfigError(
        f"data.packing=true keeps documents apart, and dataset {spec.name!r} {why}, or clear "
        "data.packing"
    )


def _packed_documents(spec: DatasetSpec, options: DataOptions) -> DatasetSpec:
    """`spec`, or with data.packing its documents kept apart in their windows (packing.py):
    each batch with segment ids, positions and a loss mask. One line if it has no documents."""
    _check_packable(spec, options)
    if not options.packing:
        return spec
    windows = functools.partial(_document_windows, spec.tokenizer.eos_id)
    return dataclasses.replace(spec, make_transform=windows, loss_mask=True, packed=True)


def _document_windows(eos_id: int, options: DataOptions) -> Transform:
    return packing.DocumentWindows(_next_character(options), eos_id)


def _instruction_spec(own: user_data.OwnData, tokenizer, options: DataOptions) -> DatasetSpec:
    """Instruction data's spec: a language model of the tokenizer's vocabulary, its rows
    rendered by the tokenizer's chat template (loaded here: one line if it has none)."""
    if tokenizer is None:
        raise ConfigError(
            f"instruction data ({', '.join(own.instruction)} columns of {own.name}) is tokenized "
            "by a Hugging Face tokenizer: set --config.data.tokenizer=DIR (its tokenizer.json and "
            "tokenizer_config.json, with the chat template)"
        )
    template = None
    if instruction.needs_template(own.train, own.instruction):
        template = load_chat_template(options.tokenizer)
    return DatasetSpec(
        own.name, LANGUAGE_MODEL, tokenizer.vocab_size, None,
        functools.partial(_fixed, instruction.MaskedNextTokens()), input_key="inputs",
        target_key="targets", own=own, tokenizer=tokenizer, loss_mask=True,
        chat_template=template, packed=options.packing,
    )  # fmt: skip


def _tokenizer_needs_text(what: str, own: bool = False) -> str:
    fix = "set data.input_key to a text column" if own else "choose a text dataset"
    return (
        f"data.tokenizer tokenizes text, and {what} is not a language model's text; clear "
        f"data.tokenizer or {fix} (text_file, shakespeare_char, or own data with a text column)"
    )


def _tokenized_spec(spec: DatasetSpec, tokenizer: tokenizer_lib.TextTokenizer) -> DatasetSpec:
    """`spec` tokenized by `tokenizer`: its outputs are the tokenizer's vocabulary."""
    return dataclasses.replace(
        spec, num_classes=tokenizer.vocab_size, vocabulary="", tokenizer=tokenizer
    )


@contextlib.contextmanager
def _exclusive(path: str):
    """One preparer at a time per data dir, across processes (pytest workers, hosts' ranks). A
    data dir nobody can write to (a read-only mount of prepared data) needs no lock."""
    if directory_problem(os.path.dirname(path), write=True):
        yield
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:  # never through a link planted in a shared data dir, never truncating
        lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise DataError(
            f"the data dir's lock file {path} cannot be opened ({e.strerror}"
            f"{': a symbolic link' if e.errno == errno.ELOOP else ''}); remove it (jddp "
            "creates a plain file)"
        ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as e:
        os.close(lock)
        raise DataError(
            f"cannot lock {path} ({e.strerror}): its file system has no working flock (NFS "
            "without lockd, Lustre without the flock mount option); use a data dir on a local "
            "disk, or mount with locking"
        ) from None
    try:
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)


def _own_dataset_spec(own: user_data.OwnData, tokenizer=None) -> DatasetSpec:
    if own.language_model:
        spec = dataclasses.replace(_language_model_spec(own.name, None, own.vocabulary), own=own)
        return _tokenized_spec(spec, tokenizer) if tokenizer is not None else spec
    columns = user_data.OwnColumns(own.input_key, own.target_key)
    return DatasetSpec(
        own.name, CLASSIFICATION, own.num_classes, None, functools.partial(_fixed, columns),
        input_key=own.input_key, target_key="label", own=own,
    )  # fmt: skip


def _fixed(transform: Transform, options: DataOptions) -> Transform:
    return transform  # own data's transform does not depend on the options


def open_dataset(spec: DatasetSpec, options: DataOptions | None = None) -> Dataset:
    """`spec`'s train and eval splits, prepared into the TFDS data dir on first use."""
    options = options or DataOptions()
    if options.tokenizer and spec.tokenizer is None:
        raise UsageError(
            f"options set data.tokenizer but the spec of {spec.name} was made without it; make "
            "the spec with get_dataset(name, options=...) given the same options"
        )
    transform = spec.make_transform(options)
    splits = (spec.train_split, spec.eval_split)
    if spec.own is not None and spec.own.instruction:
        return _instruction_splits(spec, options, transform)
    if spec.own is not None and spec.own.language_model:
        texts = {spec.train_split: spec.own.train, spec.eval_split: spec.own.eval}
        where = {spec.train_split: spec.own.train_where, spec.eval_split: spec.own.eval_where}
        if spec.tokenizer is not None:  # documents, or one whose tokens are split
            return _tokenized_splits(spec, options, texts, where, transform, spec.own.eval_fraction)
        return _language_model_splits(spec, options, texts, where, transform)
    if spec.own is not None:
        return Dataset(spec, spec.own.train, spec.own.eval, transform)
    if spec.builder_class is None and spec.tokenizer is not None:  # a text file: one document
        tokens = token_file.tokenized_text_file(
            spec.text_file, spec.tokenizer, options.resolved_data_dir, _exclusive
        )  # a token file, encoded by the first run
        fraction = text.TEXT_FILE_TEST_FRACTION
        parts = dict(zip(splits, tokenizer_lib.split_tokens(tokens, fraction), strict=True))
        where = {
            spec.train_split: f"the first {1 - fraction:g} of the tokens of {spec.text_file}",
            spec.eval_split: f"the last {fraction:g} of the tokens of {spec.text_file}",
        }
        return _windows(spec, options, parts, where, transform, "tokens")
    if spec.builder_class is None:  # a local text file, read a window at a time
        tokens = text.text_file_tokens(spec.text_file, spec.vocabulary)
        where = {split: f"the {split} part of {spec.text_file}" for split in splits}
        return _windows(spec, options, tokens, where, transform)

    problem = directory_problem(options.resolved_data_dir, write=False)
    if problem:
        raise DataError(
            f"data dir {options.resolved_data_dir!r} {problem}; pass a directory as "
            "--config.data.data_dir (or $TFDS_DATA_DIR)"
        )
    # One process at a time prepares (and decodes) a dataset: pytest workers, a host's ranks.
    with _exclusive(os.path.join(options.resolved_data_dir, f".{spec.builder_class.name}.lock")):
        builder = _prepared_builder(spec, options)
        sources = builder.as_data_source()
        if spec.kind == LANGUAGE_MODEL:  # one example per work: the split's text, in work order
            works = {
                split: [
                    work["text"].decode("utf-8")
                    for work in sorted(sources[split], key=lambda work: work["work"])
                ]
                for split in splits
            }
            where = {split: f"{spec.name} split {split}" for split in splits}
            if spec.tokenizer is not None:  # each work a document
                return _tokenized_splits(spec, options, works, where, transform)
            texts = {split: "".join(works[split]) for split in splits}
            return _language_model_splits(spec, options, texts, where, transform)
        train, test = (_split_source(builder, sources, split, spec, options) for split in splits)
        return Dataset(spec, train, test, transform)


def _prepared_builder(spec: DatasetSpec, options: DataOptions) -> tfds.core.DatasetBuilder:
    kwargs = {"data_dir": options.resolved_data_dir, "file_format": "array_record"}
    if issubclass(spec.builder_class, LocalFilesBuilder):
        kwargs["manual_dir"] = options.resolved_manual_dir
    with library_warnings_muted("tensorflow_datasets"):  # "variant folder has no info"
        builder = spec.builder_class(**kwargs)
        if builder.is_prepared():
            return builder
    problem = directory_problem(options.resolved_data_dir, write=True)
    if problem:
        raise DataError(
            f"dataset {spec.name} is not prepared in {options.resolved_data_dir!r}, which "
            f"{problem}; pass a writable --config.data.data_dir (or prepare it there once)"
        )
    if isinstance(builder, LocalFilesBuilder):
        builder.check_sources()  # missing files: one line now, before TFDS starts and logs
    # One line says what happens; TFDS's progress bars (stderr) and banners (stdout) would not.
    logging.info("preparing dataset %s in %s (once, on first use)", spec.name, builder.data_dir)
    tfds.display_progress_bar(False)
    with library_warnings_muted("tensorflow_datasets", stdout=True):
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=options.resolved_manual_dir)
        )
    return builder


def _split_source(builder, sources, split: str, spec: DatasetSpec, options: DataOptions):
    """The split's TFDS source, or its numpy copy if small and made of fixed-shape features."""
    features = (spec.input_key, spec.target_key)
    fixed_shapes = all(None not in builder.info.features[name].shape for name in features)
    small = builder.info.splits[split].num_bytes <= options.cache_max_mb * 2**20
    if not (small and fixed_shapes):
        return sources[split]
    folder = os.path.join(
        options.resolved_data_dir, "decoded", builder.name, str(builder.version), split
    )
    if not is_decoded(folder) and directory_problem(folder, write=True):
        return sources[split]  # a read-only data dir: read the TFDS files as they are
    return decoded_split(sources[split], folder, features)


def _language_model_splits(spec, options, texts, where, transform) -> Dataset:
    """Token windows of `seq_len` over the train and eval texts."""
    tokens = {split: text.encode(texts[split], spec.vocabulary, where[split]) for split in texts}
    return _windows(spec, options, tokens, where, transform)


def _windows(spec, options, tokens, where, transform, unit="characters") -> Dataset:
    """Token windows of `seq_len` over the train and eval tokens (arrays, or a file's)."""
    train, test = spec.train_split, spec.eval_split
    return Dataset(
        spec,
        text.language_model_windows(tokens[train], options.seq_len, True, where[train], unit),
        text.language_model_windows(tokens[test], options.seq_len, False, where[test], unit),
        transform,
    )


def _instruction_splits(spec, options, transform) -> Dataset:
    """Instruction rows tokenized with their loss masks, one example each; logs what they hold."""
    own, loss_on = spec.own, options.loss_on or "completion"
    tokenized = [
        instruction.tokenize(
            table, own.instruction, spec.tokenizer, spec.chat_template, options.seq_len, loss_on
        )
        for table in (own.train, own.eval)
    ]
    logging.info("%s", instruction.summary(spec.name, own.instruction, *tokenized, loss_on))
    if spec.packed:
        tokenized = [packing.PackedRows(rows) for rows in tokenized]
        logging.info("%s", packing.summary(spec.name, tokenized[0]))
    train, test = tokenized
    return Dataset(spec, train, test, transform)


def _tokenized_splits(spec, options, documents, where, transform, eval_fraction=0.0) -> Dataset:
    """Token windows over the train and eval documents, each packed by the spec's tokenizer; an
    eval split of None is the last `eval_fraction` of the train tokens (one document)."""
    train, test = spec.train_split, spec.eval_split
    tokens = {train: spec.tokenizer.pack(documents[train])}
    if documents[test] is None:
        tokens[train], tokens[test] = tokenizer_lib.split_tokens(tokens[train], eval_fraction)
    else:
        tokens[test] = spec.tokenizer.pack(documents[test])
    if spec.packed:
        summary = packing.document_summary(
            spec.name, tokens[train], spec.tokenizer.eos_id, options.seq_len
        )
        logging.info("%s", summary)
    return _windows(spec, options, tokens, where, transform, "tokens")
