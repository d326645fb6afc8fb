"""Own data from the config: `npz:`, `jsonl:`, `parquet:`, `hf:` and `package.module:function`
give the same rows; training on them equals a plain one-device optax loop over the rows in the
documented order, through the library and the CLI (from another directory); a rerun resumes bit
for bit; evaluation counts every example once; two processes read disjoint rows; a text column
trains a language model; every mistake is one line."""

import json
import shutil
import sys

import numpy as np
import optax
import pytest

from jddp import data, models
from jddp.checkpoints.weights import load_params
from jddp.data import tables, text
from jddp.errors import ConfigError, DataError
from jddp.models.mlp import MLP
from jddp.run import factory, optim
from jddp.run.config import default_config
from jddp.run.experiment import train_and_evaluate
from tests.commands_in_one_process import run_commands
from tests.helpers import (
    BeforeRerun,
    assert_accuracy_over,
    assert_error_exit,
    assert_one_line,
    metrics_lines,
)
from tests.own_data_files import global_batch_rows, global_batches, write_files, write_hf
from tests.reference import plain_training

N_TRAIN, N_EVAL, FEATURES, CLASSES = 20, 13, 6, 4
BATCH, EVAL_BATCH, STEPS = 8, 8, 4  # 4 steps of 8 cross into the second epoch of 20 rows


def make_rows(count, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, FEATURES)).astype(np.float32)
    label = x[:, :CLASSES].argmax(1).astype(np.int64)
    return {"x": x, "label": label}


TRAIN, EVAL = make_rows(N_TRAIN, 0), make_rows(N_EVAL, 1)

FUNCTION_MODULE = """
import os
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


class Records:  # a grain random-access source of dict records
    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays["label"])

    def __getitem__(self, i):
        return {"x": self.arrays["x"][i], "label": int(self.arrays["label"][i])}


def splits():
    train = dict(np.load(os.path.join(HERE, "train.npz")))
    return {"train": Records(train), "test": dict(np.load(os.path.join(HERE, "test.npz")))}
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same rows in every format, under one folder that is importable (the function's)."""
    import datasets

    root = tmp_path_factory.mktemp("own")
    write_files(root, {"train": TRAIN, "test": EVAL})
    features = datasets.Features(
        {
            "x": datasets.Sequence(datasets.Value("float32")),  # a List in datasets 4+
            "label": datasets.ClassLabel(num_classes=CLASSES + 1),  # declares one class unseen
        }
    )
    write_hf(root / "hf", {"train": TRAIN, "validation": EVAL}, features)
    (root / "own_rows.py").write_text(FUNCTION_MODULE)
    sys.path.append(str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("own_rows", None)


def named(root, fmt) -> tuple[str, data.DataOptions]:
    """The dataset name and options of format `fmt` for the files under `root`."""
    if fmt == "hf":
        return f"hf:{root}/hf", data.DataOptions()  # the DatasetDict's validation split
    if fmt == "function":
        return "own_rows:splits", data.DataOptions()  # its dict's test split
    eval_path = f"{root}/test.{fmt}" if fmt == "npz" else f"{fmt}:{root}/test.{fmt}"
    return f"{fmt}:{root}/train.{fmt}", data.DataOptions(eval_path=eval_path)  # bare path: npz


# ------------------------------------------------------------------- every format, the same rows
@pytest.mark.parametrize("fmt", ["npz", "jsonl", "parquet", "hf", "function"])
def test_every_format_gives_the_same_rows_and_classes(files, fmt):
    name, options = named(files, fmt)
    spec = data.get_dataset(name, options=options)
    assert (spec.kind, spec.input_key, spec.target_key) == ("classification", "x", "label")
    # max label + 1 over both splits; a `datasets` ClassLabel's declared count where larger
    assert spec.num_classes == (CLASSES + 1 if fmt == "hf" else CLASSES)
    opened = data.open_dataset(spec)
    for source, rows in ((opened.train, TRAIN), (opened.eval, EVAL)):
        assert len(source) == len(rows["label"])
        batch = opened.transform(source.read_batch(np.arange(len(source))))
        assert batch["x"].dtype == np.float32 and batch["label"].dtype == np.int32
        np.testing.assert_array_equal(batch["x"], rows["x"])
        np.testing.assert_array_equal(batch["label"], rows["label"])
        assert source[3]["x"].tolist() == rows["x"][3].tolist()  # grain's record protocol


def test_a_held_out_fraction_is_a_permutation_seeded_zero(files):
    spec = data.get_dataset(f"npz:{files}/train.npz", options=data.DataOptions(eval_fraction=0.25))
    opened = data.open_dataset(spec)
    held = np.sort(np.random.default_rng(0).permutation(N_TRAIN)[:5])  # the documented rule
    kept = np.setdiff1d(np.arange(N_TRAIN), held)
    np.testing.assert_array_equal(opened.eval.read_batch(np.arange(5))["x"], TRAIN["x"][held])
    np.testing.assert_array_equal(opened.train.read_batch(np.arange(15))["x"], TRAIN["x"][kept])


# ------------------------------------------------- training: a plain loop, the CLI, exact resume
def own_config(dataset, eval_path):
    config = default_config()
    config.model, config.model_args.hidden_sizes = "mlp", (16,)
    config.dataset, config.data.eval_path = dataset, eval_path
    config.global_batch_size, config.eval_batch_size = BATCH, EVAL_BATCH
    config.num_train_steps, config.warmup_steps, config.learning_rate = STEPS, 0, 1e-2
    config.log_every, config.eval_every, config.checkpoint_every = 1, STEPS, 2
    return config


@pytest.fixture(scope="module")
def reference(files):
    """Losses of a plain one-device optax loop over the rows in the loader's documented order
    (tests/own_data_files.py), and its final eval loss over all 13."""
    config = own_config(f"npz:{files}/train.npz", f"{files}/test.npz")
    spec = factory.dataset_spec(config)
    trainer = factory.build_trainer(config, spec)
    sample = factory.sample_batch(config, spec)
    params = trainer.host_state(trainer.init(config.seed, sample)).params  # the same start
    batches = global_batches(TRAIN, BATCH, STEPS, seed=config.seed)
    model = MLP(num_classes=CLASSES, hidden_sizes=(16,))

    def mean_loss(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    def loss_fn(params, model_state, batch):
        return mean_loss(params, batch), model_state

    optimizer = optim.create_optimizer(config, optim.learning_rate_schedule(config))
    final, _, losses = plain_training(loss_fn, params, {}, optimizer, batches)
    eval_loss = float(mean_loss(final, {"x": EVAL["x"], "label": EVAL["label"]}))
    return {"losses": losses, "eval_loss": eval_loss}


def records(workdir) -> list[dict]:
    return [json.loads(line) for line in metrics_lines(workdir)]


def assert_matches_reference(history, reference):
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in history], reference["losses"], rtol=1e-5)
    # Eval over 13 examples in padded batches of 8: each counted once, none twice.
    assert history[-1]["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    assert_accuracy_over(history[-1]["eval_accuracy"], N_EVAL)


def test_training_equals_a_plain_loop_and_resumes_bit_for_bit(files, reference, tmp_path):
    workdir = tmp_path / "run"
    config = own_config(f"parquet:{files}/train.parquet", f"parquet:{files}/test.parquet")
    train_and_evaluate(config, str(workdir))
    first = records(workdir)
    assert_matches_reference(first, reference)

    shutil.rmtree(workdir / "checkpoints" / str(STEPS))  # the rerun resumes at step 2
    before = BeforeRerun(workdir, resume_step=2)
    train_and_evaluate(config, str(workdir))
    before.assert_resumed(log_every=1)
    again = records(workdir)
    for key in ("loss", "grad_norm", "eval_loss"):
        assert [r.get(key) for r in again] == [r.get(key) for r in first], key


CLI_CONFIG = f"""
from jddp.run.config import default_config


def get_config():  # own_config's settings, as a user's config file would write them
    config = default_config()
    config.model, config.model_args.hidden_sizes = "mlp", (16,)
    config.dataset, config.data.eval_path = "digits", "data/test.npz"
    config.global_batch_size, config.eval_batch_size = {BATCH}, {EVAL_BATCH}
    config.num_train_steps, config.warmup_steps, config.learning_rate = {STEPS}, 0, 1e-2
    config.log_every, config.eval_every, config.checkpoint_every = 1, {STEPS}, 2
    return config
"""


def test_the_cli_trains_own_data_from_another_directory(files, reference, tmp_path):
    (tmp_path / "data").mkdir()
    for split in ("train", "test"):
        shutil.copy(files / f"{split}.npz", tmp_path / "data")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "own.py").write_text(CLI_CONFIG)
    run = ["experiments.train", "--config=configs/own.py", "--config.dataset=npz:data/train.npz"]
    result, missing = run_commands(  # one process; relative paths start at its cwd
        [[*run, "--workdir=run"], [*run, "--config.data.eval_path=data/tset.npz", "--workdir=bad"]],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert_matches_reference(records(tmp_path / "run"), reference)
    assert_error_exit(missing, "npz:data/tset.npz does not exist")
    assert not (tmp_path / "bad").exists()  # checked before anything is written


# ------------------------------------------------------------- two processes: disjoint rows
class Recorded(tables.Table):
    """A table that notes every row it is asked for."""

    def __init__(self, table):
        self.table, self.columns, self.where, self.read = table, table.columns, "", []

    def __len__(self):
        return len(self.table)

    def read_batch(self, indices):
        self.read.append(np.asarray(indices).tolist())
        return self.table.read_batch(indices)


def test_each_process_reads_only_its_rows(files):
    name, options = named(files, "parquet")
    spec = data.get_dataset(name, options=options)
    opened = data.open_dataset(spec)
    steps = global_batch_rows(N_TRAIN, BATCH, 20)
    read = {}
    for process in (0, 1):
        train, test = Recorded(opened.train), Recorded(opened.eval)
        batches = data.train_batches(
            train, opened.transform, global_batch_size=BATCH, seed=0,
            process_index=process, process_count=2,
        )  # fmt: skip
        for _ in range(3):
            next(batches)
        batches.close()
        mine = steps[:, process * 4 : (process + 1) * 4].tolist()
        # Steps 0-2 were read, and every read (the loader reads ahead) is this process's rows.
        assert all(rows in train.read for rows in mine[:3])
        assert all(rows in mine for rows in train.read)
        masks = [
            b["mask"]
            for b in data.eval_batches(
                test, opened.transform, batch_size=EVAL_BATCH, process_index=process,
                process_count=2,
            )
        ]  # fmt: skip
        read[process] = [i for rows in test.read for i in rows if rows]
        assert sum(int(m.sum()) for m in masks) == len(read[process])
    assert sorted(read[0] + read[1]) == list(range(N_EVAL))  # every eval row once, in total


# ------------------------------------------------------------- a text column: a language model
def test_a_text_column_trains_a_language_model(tmp_path):
    lines = [f"row {i}: the quick brown fox jumps over {i % 7} lazy dogs" for i in range(40)]
    path = tmp_path / "text.jsonl"
    path.write_text(
        "".join(json.dumps({"text": line, "id": i}) + "\n" for i, line in enumerate(lines))
    )
    options = data.DataOptions(eval_fraction=0.1, seq_len=16)
    spec = data.get_dataset(f"jsonl:{path}", options=options)
    joined = "\n".join(lines)  # the rows' texts joined by newlines; the last 10% held out
    cut = int(len(joined) * 0.9)
    assert spec.kind == "language_model" and spec.vocabulary == "".join(sorted(set(joined)))
    opened = data.open_dataset(spec, options)
    assert text.decode(opened.train.tokens, spec.vocabulary) == joined[:cut]
    assert text.decode(opened.eval.tokens, spec.vocabulary) == joined[cut:]

    from experiments.configs import shakespeare_gpt_tiny

    config = shakespeare_gpt_tiny.get_config()
    config.dataset, config.data.eval_fraction, config.data.seq_len = f"jsonl:{path}", 0.1, 16
    config.model_args.update(num_layers=1, embed_dim=32, max_seq_len=16)
    config.global_batch_size, config.num_train_steps, config.warmup_steps = 8, 2, 0
    config.log_every = config.eval_every = config.checkpoint_every = 2
    summary = train_and_evaluate(config, str(tmp_path / "run"))
    # The reference: the trained GPT applied here to the held-out text, as windows of 17 tokens
    # every 16 (each token a target once), its mean token cross-entropy.
    model = models.create_model("gpt", len(spec.vocabulary), **config.model_args)
    held_out = opened.eval.tokens
    windows = np.stack([held_out[i : i + 17] for i in range(0, len(held_out) - 16, 16)])
    logits = model.apply({"params": load_params(str(tmp_path / "run"))}, windows[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()
    assert summary["eval_loss"] == pytest.approx(float(loss), rel=1e-5)
    assert summary["eval_perplexity"] == pytest.approx(float(np.exp(loss)), rel=1e-5)


# ------------------------------------------------------------------- mistakes: one line each
def _npz(path, **arrays):
    np.savez(path, **arrays)
    return f"npz:{path}"


def _text(path, content):
    path.write_text(content)
    return f"{path.suffix[1:]}:{path}"


X, Y = np.zeros((5, 2), np.float32), np.arange(5)
MISTAKES = [
    # (make the data under tmp -> dataset name, DataOptions fields, error type, words)
    (lambda t: f"npz:{t}/none.npz", {}, DataError, ["none.npz does not exist"]),
    (lambda t: f"csv:{t}/a.csv", {}, ConfigError, ["unknown scheme 'csv'", "npz:PATH", "hf:PATH"]),
    (lambda t: f"{t}/a.npz", {}, ConfigError, ["did you mean npz:"]),
    (lambda t: _npz(t / "a.npz", x=X, label=Y[:4]), {}, DataError, ["x: 5, label: 4"]),
    (lambda t: _npz(t / "a.npz", x=X, label=Y), {}, ConfigError, ["no eval split", "eval_path"]),
    (lambda t: _npz(t / "a.npz", a=X, b=X), {"eval_fraction": 0.2}, ConfigError, ["a, b"]),
    (lambda t: _npz(t / "a.npz", x=X, y=Y), {"input_key": "z"}, ConfigError, ["'z'", "x, y"]),
    (
        lambda t: _npz(t / "a.npz", x=X, label=Y + 0.5),
        {"eval_fraction": 0.2},
        DataError,
        ["float64, not integers"],
    ),  # fmt: skip
    (
        lambda t: _npz(t / "a.npz", x=X, label=Y),
        {"eval_fraction": 1.0},
        ConfigError,
        ["eval_fraction must be in [0, 1)"],
    ),  # fmt: skip
    (
        lambda t: _npz(t / "a.npz", x=X, label=Y),
        {"eval_fraction": 0.2, "eval_path": "b.npz"},
        ConfigError,
        ["both set"],
    ),  # fmt: skip
    (
        lambda t: _npz(t / "a.npz", x=X, label=Y),
        {"eval_fraction": 0.2, "num_classes": 3},
        DataError,
        ["label 4", "num_classes=3"],
    ),  # fmt: skip
    (lambda t: "digits", {"eval_fraction": 0.2}, ConfigError, ["built in"]),
    (lambda t: _text(t / "a.npz", "not an archive"), {}, DataError, ["not a NumPy archive"]),
    (lambda t: _text(t / "a.jsonl", ""), {}, DataError, ["holds no rows"]),
    (
        lambda t: _text(t / "a.jsonl", '{"x": 1, "label": 0}\n{"x": 2}\n'),
        {},
        DataError,
        ["line 2", "same keys"],
    ),  # fmt: skip
    (
        lambda t: _text(t / "a.jsonl", '{"x": [1, 2], "label": 0}\n{"x": [1], "label": 1}\n'),
        {"eval_fraction": 0.5},
        DataError,
        ["ragged"],
    ),  # fmt: skip
    (lambda t: _text(t / "a.jsonl", "{oops\n"), {}, DataError, ["line 1 is not JSON"]),
    (lambda t: _text(t / "a.parquet", "not parquet"), {}, DataError, ["not a readable Parquet"]),
    (lambda t: f"hf:{t}", {}, DataError, ["save_to_disk"]),
    (lambda t: "no_such_module_here:rows", {}, ConfigError, ["no module", "sys.path"]),
]


@pytest.mark.parametrize("make,fields,error_type,words", MISTAKES)
def test_mistakes_are_one_line(tmp_path, make, fields, error_type, words):
    name = make(tmp_path)
    with pytest.raises(error_type) as error:
        data.get_dataset(name, options=data.DataOptions(**fields))
    assert_one_line(error, *words)


def test_hf_without_the_datasets_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ConfigError) as error:
        data.get_dataset(f"hf:{tmp_path}")
    assert_one_line(error, "pip install 'jddp[hf]'")
