"""The bad-input contract where it used to leak, checked in-process: each mistake is a typed
one-line `JddpError` raised before anything is written (the CLI prints exactly that line and
exits 2, as tests/test_cli_errors.py shows for a few): non-finite or out-of-range values, layers
of no width, file-system conditions, messages that named the wrong key; and the launcher's own
mistakes, which end it in one line too."""

import math
import sys

import pytest

import jddp.runtime.launch
from experiments.configs import digits_mlp
from jddp.errors import ConfigError, DataError, WorkdirError
from jddp.run import config as config_lib
from jddp.run.experiment import train_and_evaluate
from tests.helpers import assert_error_output, assert_one_line, configured, read_only_dir


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("learning_rate", math.inf, ["learning_rate", "finite number > 0", "inf"]),
        ("learning_rate", math.nan, ["learning_rate", "finite number > 0", "nan"]),
        ("weight_decay", math.nan, ["weight_decay", "finite number >= 0", "nan"]),
        ("grad_clip_norm", math.nan, ["grad_clip_norm", "finite number >= 0"]),
        ("grad_clip_norm", math.inf, ["grad_clip_norm", "finite number >= 0"]),
        ("peak_flops_per_device", math.inf, ["peak_flops_per_device", "finite"]),
        ("adam_b1", 1.0, ["adam_b1 must be in [0, 1), got 1.0"]),
        ("adam_b2", -0.1, ["adam_b2 must be in [0, 1), got -0.1"]),
        ("adam_b2", math.nan, ["adam_b2 must be in [0, 1)"]),
        ("momentum", 1.5, ["momentum must be in [0, 1)"]),
        ("min_lr_ratio", math.nan, ["min_lr_ratio must be in [0, 1]"]),
        ("seed", -1, ["seed must be an integer from 0 to 2**63 - 1, got -1"]),
        ("seed", 2**63, ["seed must be an integer from 0 to 2**63 - 1"]),
    ],
)
def test_non_finite_and_out_of_range_values_are_refused(key, value, words):
    config = digits_mlp.get_config()
    config[key] = value
    with pytest.raises(ConfigError) as error:
        config_lib.validate(config)
    assert_one_line(error, *words, f"--config.{key}")


def text_file_config(path):
    config = digits_mlp.get_config()
    config.dataset, config.data.text_file = "text_file", str(path)
    return config


def with_values(config=None, **values):
    """`config` (digits_mlp's) with `data__seq_len=8` and the like set (`__` for a dot)."""
    settings = {dotted.replace("__", "."): value for dotted, value in values.items()}
    return configured(config or digits_mlp.get_config(), settings)


@pytest.mark.parametrize(
    "make_config,error_type,words",
    [
        (
            lambda tmp: with_values(model_args__hidden_sizes=(64, 0)),
            ConfigError,
            ["model_args.hidden_sizes=(64, 0)", "size below 1", "--config.model_args.hidden_sizes"],
        ),
        (  # the eval batch, not the global batch, is what does not divide
            lambda tmp: with_values(eval_batch_size=100),
            ConfigError,
            ["eval_batch_size=100 is not divisible by the 8 devices", "96 or 104"],
        ),
        (
            lambda tmp: text_file_config(tmp),
            DataError,
            ["data.text_file", "is a directory", "UTF-8 text file"],
        ),
        (
            lambda tmp: with_values(data__data_dir=str(tmp / "notes.txt")),
            DataError,
            ["data dir", "notes.txt' is a file", "--config.data.data_dir"],
        ),
        (
            lambda tmp: with_values(data__data_dir=str(tmp / "notes.txt" / "tfds")),
            DataError,
            ["data dir", "is under", "notes.txt', which is a file"],
        ),
    ],
    ids=["zero-width layer", "eval batch", "text file is a dir", "data dir is a file", "under one"],
)
def test_mistakes_found_before_anything_is_written(tmp_path, make_config, error_type, words):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(error_type) as error:
        train_and_evaluate(make_config(tmp_path), str(tmp_path / "run"))
    assert_one_line(error, *words)
    assert not (tmp_path / "run").exists()
    assert (tmp_path / "notes.txt").read_text() == "keep me"


FIXED_OUTPUTS = """
import flax.linen as nn
from flax import nnx


class ThreeClasses(nn.Module):  # decides its outputs itself: no num_outputs argument
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


class ThreeClassesNnx(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.head = nnx.Linear(64, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(x.reshape(x.shape[0], -1))


class FourTokens(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(4)(nn.Embed(64, 8)(tokens))
"""


@pytest.mark.parametrize(
    "model,text,words",
    [
        ("ThreeClasses", False, ["gives 3 outputs per example", "fewer than the 10 classes of"]),
        ("ThreeClassesNnx", False, ["gives 3 outputs", "the 10 classes of digits"]),
        ("FourTokens", True, ["gives 4 outputs", "fewer than the 8 tokens of text_file's"]),
    ],
)
def test_an_own_model_with_fewer_outputs_than_the_data_is_refused(
    tmp_path, monkeypatch, model, text, words
):
    """An own model without a `num_outputs` argument trained on without a word when it had
    fewer outputs than the dataset's classes (or a language model's vocabulary)."""
    package = tmp_path / "fixed_output_nets"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(FIXED_OUTPUTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = text_file_config(tmp_path / "corpus.txt") if text else digits_mlp.get_config()
    config.data.seq_len = 16
    (tmp_path / "corpus.txt").write_text("to be or not to be\n" * 40)  # 8 characters
    config.model, config.model_args = f"fixed_output_nets.nets:{model}", {}
    with pytest.raises(ConfigError) as error:
        train_and_evaluate(config, str(tmp_path / "run"))
    assert_one_line(error, f"model 'fixed_output_nets.nets:{model}'", *words, "num_outputs")
    assert not (tmp_path / "run").exists()


def test_a_workdir_under_a_file_or_on_a_read_only_file_system_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(WorkdirError) as error:
        train_and_evaluate(digits_mlp.get_config(), str(tmp_path / "notes.txt" / "run"))
    assert_one_line(error, "is under", "notes.txt', which is a file", "--workdir")
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    with read_only_dir(tmp_path / "ro") as folder:
        with pytest.raises(WorkdirError) as error:
            train_and_evaluate(digits_mlp.get_config(), str(folder / "run"))
        assert_one_line(error, "workdir", "--workdir")
        assert "read-only file system" in str(error.value) or "no permission" in str(error.value)
        # and a data dir there that still has to be prepared
        config = with_values(data__data_dir=str(folder / "tfds"))
        with pytest.raises(DataError) as error:
            train_and_evaluate(config, str(tmp_path / "run"))
        assert_one_line(error, "dataset digits is not prepared in", "writable --config.data")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------- launcher
def launch(capsys, *argv):
    """(exit code, stderr lines) of `jddp-launch ARGV`, run in this process."""
    try:
        code = jddp.runtime.launch.main(list(argv))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--nproc=1", "--devices_per_proc=-1", "--", "true"], ["--devices_per_proc", "least 0"]),
        (["--nproc=0", "--", "true"], ["--nproc must be at least 1, got 0"]),
        (["--nprocs=2", "--", "true"], ["--nproc", "required", "--help"]),
        (["--nproc=1", "--", "no-such-command-jddp"], ["cannot run 'no-such-command-jddp'"]),
        (["--nproc=4:2", "--", "true"], ["--nproc=4:2", "MAX must be at least MIN"]),
        (["--nproc=two", "--", "true"], ["--nproc must be N or MIN:MAX, got 'two'"]),
        (["--nproc=2", "--max_restarts=-1", "--", "true"], ["--max_restarts", "least 0"]),
        (["--nproc=2", "--slots_file=s", "--", "true"], ["--slots_file needs --nproc=MIN:MAX"]),
    ],
    ids=[
        "negative devices",
        "no processes",
        "misspelt flag",
        "no such command",
        "range upside down",
        "not a count",
        "negative restarts",
        "slots without a range",
    ],
)
def test_launcher_mistakes_are_one_line(capsys, argv, words):
    code, lines = launch(capsys, *argv)
    assert code == 2, lines
    assert_error_output("\n".join(lines), *words)


def test_a_childs_one_line_error_is_the_launchers_last_line(capsys):
    child = "import sys; print('error: the child says why', file=sys.stderr); sys.exit(2)"
    code, lines = launch(capsys, "--nproc=2", "--", sys.executable, "-c", child)
    assert code == 2
    assert lines[-1] == "error: the child says why", lines
