"""Own models and own data from the config: `config.model = "package.module:Name"` names a
Linen or NNX class or a function in a user package written outside jddp, beside the config file,
and `config.dataset` the user's rows as npz, Parquet or a `datasets` save_to_disk folder (JSON
Lines: tests/test_train_command.py). Built in-process (every mistake one ConfigError line), and
trained by the installed `jddp-train` started from another directory under ddp, zero3 and a
tensor mesh with the config's own rules: every step's loss, and the eval loss, equal a plain
single-device optax loop written here over the same rows in the loader's documented order.
Killed after a checkpoint and rerun, a run with dropout is bit for bit the uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp import models
from jddp.run import factory
from tests.helpers import (
    BeforeRerun,
    assert_accuracy_over,
    assert_error_exit,
    assert_one_line,
    committed_checkpoints,
    metrics_lines,
)
from tests.own_data_files import as_loaded, global_batches, write_files, write_hf
from tests.reference import plain_training
from tests.test_resume_kill import assert_same_run, logged_steps, wait_until

JDDP_TRAIN = os.path.join(os.path.dirname(sys.executable), "jddp-train")  # installed beside it
PACKAGE = "own_nets"  # the user's package, beside the config file
STEPS, GLOBAL_BATCH, LEARNING_RATE, WIDTH = 6, 32, 1e-2, 24
# The user's rows: 80 to train on (6 steps of 32 cross two epoch boundaries, one inside a
# batch) and 21 to evaluate (a padded last batch); 64 features, 10 classes.
N_TRAIN, N_EVAL, FEATURES, CLASSES = 80, 21, 64, 10


def make_rows(count: int, seed: int) -> dict:
    """A task a small net learns in a few steps: the label is the largest of the first 10
    features."""
    x = np.random.default_rng(seed).normal(size=(count, FEATURES)).astype(np.float32)
    return {"x": x, "label": x[:, :CLASSES].argmax(1)}


TRAIN, EVAL = make_rows(N_TRAIN, 0), make_rows(N_EVAL, 1)
# The config's own tensor layout for LinenNet: Megatron's column split of fc, row split of head.
OWN_RULES = (("fc/kernel", "fsdp,tensor"), ("fc/bias", "tensor"), ("head/kernel", "tensor,fsdp"))

NETS = """
import flax.linen as nn
from flax import nnx


class LinenNet(nn.Module):
    num_outputs: int
    width: int = 32
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(self.width, name="fc")(x.reshape(x.shape[0], -1)))
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_outputs, name="head")(x)


class NnxNet(nnx.Module):
    def __init__(self, num_outputs: int, rngs: nnx.Rngs, width: int = 32):
        self.fc = nnx.Linear(64, width, rngs=rngs)
        self.head = nnx.Linear(width, num_outputs, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.fc(x.reshape(x.shape[0], -1))))


class NormNet(nn.Module):  # declares the batch axis: jddp fills it in
    num_outputs: int
    batch_axis_name: str | tuple | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.batch_axis_name)(x)
        return nn.Dense(self.num_outputs)(x.reshape(x.shape[0], -1))


class NeedsFeatures(nn.Module):
    features: int

    def __call__(self, x):
        return x


class Picky(nn.Module):
    num_outputs: int
    width: int = 8

    def __post_init__(self):
        if self.width % 2:
            raise ValueError(f"width {self.width} must be even")
        super().__post_init__()


def make_net(num_outputs, width=32):
    return LinenNet(num_outputs=num_outputs, width=width)


def make_list():
    return []


class Plain:
    pass


NOT_A_MODEL = 3
"""

CONFIG = """
from jddp.run.config import default_config


def get_config():
    config = default_config()
    config.model = "{package}.nets:LinenNet"
    config.model_args.width = {width}
    config.dataset = "npz:{data}/train.npz"
    config.data.eval_path = "npz:{data}/test.npz"
    config.global_batch_size = {batch}
    config.num_train_steps = {steps}
    config.learning_rate = {lr}
    config.log_every = 1
    config.eval_every = {steps}
    config.checkpoint_every = 0
    return config
"""


def write_user_package(folder) -> str:
    """The user's package, config file and rows (`data_flags`) in `folder`; returns the config
    file's path."""
    data_folder = os.path.join(folder, "data")
    os.makedirs(data_folder)
    write_files(data_folder, {"train": TRAIN, "test": EVAL})
    write_hf(os.path.join(data_folder, "hf"), {"train": TRAIN, "test": EVAL})
    package = os.path.join(folder, PACKAGE)
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write("")
    with open(os.path.join(package, "nets.py"), "w") as f:
        f.write(textwrap.dedent(NETS))
    path = os.path.join(folder, "own_config.py")
    with open(path, "w") as f:
        f.write(
            CONFIG.format(
                package=PACKAGE,
                width=WIDTH,
                data=data_folder,
                batch=GLOBAL_BATCH,
                steps=STEPS,
                lr=LEARNING_RATE,
            )
        )
    return path


def data_flags(config_path, fmt: str) -> list[str]:
    """`--config` flags that train on the user's rows as `fmt` (npz is the config's own)."""
    folder = os.path.join(os.path.dirname(config_path), "data")
    if fmt == "hf":  # the DatasetDict's own test split is the eval split
        return [f"--config.dataset=hf:{folder}/hf", "--config.data.eval_path="]
    return [
        f"--config.dataset={fmt}:{folder}/train.{fmt}",
        f"--config.data.eval_path={fmt}:{folder}/test.{fmt}",
    ]


@pytest.fixture(scope="module")
def own_config(tmp_path_factory):
    return write_user_package(tmp_path_factory.mktemp("user"))


@pytest.fixture
def importable(own_config, monkeypatch):
    """The user package importable in this process (as jddp-train makes the config's folder)."""
    monkeypatch.syspath_prepend(os.path.dirname(own_config))


def jddp_train(config_path, *flags) -> list[str]:
    return [JDDP_TRAIN, f"--config={config_path}", *flags]


def child_env(env=None) -> dict[str, str]:
    return {**os.environ, **(env or {})}


def train_cli(config_path, cwd, *flags, env=None, timeout=300):
    """The installed `jddp-train` on `config_path`, started in `cwd`."""
    return subprocess.run(
        jddp_train(config_path, *flags),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
    )


def logged(workdir) -> list[dict]:
    return [json.loads(line) for line in metrics_lines(workdir)]


# ---------------------------------------------------------------- the independent reference
def reference_run(apply, params) -> dict:
    """One device, plain optax: Adam on the config's cosine schedule (weight decay 0), the mean
    cross-entropy over each whole global batch of the user's rows in the loader's documented
    order; each step's loss, and the final parameters' mean loss over the eval rows."""
    optimizer = optax.adam(optax.cosine_decay_schedule(LEARNING_RATE, STEPS))

    def mean_loss(params, batch):
        logits = apply(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    def loss_fn(params, model_state, batch):
        return mean_loss(params, batch), model_state

    batches = global_batches(TRAIN, GLOBAL_BATCH, STEPS, seed=0)
    final, _, losses = plain_training(loss_fn, params, {}, optimizer, batches)
    return {"losses": losses, "eval_loss": float(mean_loss(final, as_loaded(EVAL)))}


def linen_reference() -> dict:
    """LinenNet from the initial parameters jddp draws for seed 0 (those of one device)."""
    from own_nets.nets import LinenNet

    model = LinenNet(num_outputs=CLASSES, width=WIDTH)
    sample = as_loaded({key: value[:1] for key, value in TRAIN.items()})
    one_device = jddp.Trainer(
        model,
        jddp.losses.softmax_cross_entropy,
        optax.sgd(0.0),
        devices=jax.devices()[:1],
        input_key="x",
    )
    initial = one_device.host_state(one_device.init(0, sample)).params
    return reference_run(lambda p, x: model.apply({"params": p}, x), initial)


def nnx_reference() -> dict:
    """NnxNet as the user builds it with nnx.Rngs(seed 0)."""
    from own_nets.nets import NnxNet

    graphdef, params = nnx.split(NnxNet(CLASSES, rngs=nnx.Rngs(0), width=WIDTH))
    return reference_run(lambda p, x: nnx.merge(graphdef, p)(x), params)


@pytest.fixture(scope="module")
def references(own_config) -> dict:
    """{model: its reference run}: the same for every format (the same rows)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(os.path.dirname(own_config))
        return {"LinenNet": linen_reference(), "NnxNet": nnx_reference()}


def assert_matches_reference(workdir, reference) -> None:
    """`workdir`'s run logged every step's loss and the final eval of the reference run."""
    history = logged(workdir)
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in history], reference["losses"], rtol=1e-5)
    assert history[-1]["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    assert_accuracy_over(history[-1]["eval_accuracy"], N_EVAL)  # each eval row counted once
    losses = reference["losses"]
    assert losses[-1] < losses[0] - 0.1  # it learns: the comparison is not of constants


# ------------------------------------------------------------------- jddp-train, 8 devices
@pytest.mark.parametrize(
    "model,fmt,flags",
    [
        ("LinenNet", "npz", ["--config.parallel.strategy=ddp"]),
        (
            "NnxNet",
            "parquet",
            ["--config.parallel.strategy=zero3", "--config.parallel.min_shard_size=1"],
        ),
        (
            "LinenNet",
            "hf",
            [
                "--config.parallel.strategy=zero3",
                "--config.parallel.mesh=data:2,fsdp:2,tensor:2",
                f"--config.parallel.rules={OWN_RULES!r}",
            ],
        ),
    ],
    ids=["linen-npz-ddp", "nnx-parquet-zero3", "linen-save-to-disk-tensor-mesh-own-rules"],
)
def test_jddp_train_from_another_directory_equals_one_device(
    own_config, references, tmp_path, model, fmt, flags
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = train_cli(
        own_config,
        elsewhere,
        f"--config.model={PACKAGE}.nets:{model}",
        *data_flags(own_config, fmt),
        "--workdir=run",  # relative: under the directory jddp-train started in
        *flags,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: eval accuracy" in result.stdout
    assert_matches_reference(elsewhere / "run", references[model])
    if any("tensor" in flag for flag in flags):
        # The own rules took effect: fc and head split over fsdp x tensor, so each device holds
        # well under half the replicated state (parameters and Adam's two moments, float32).
        params = WIDTH * FEATURES + WIDTH + CLASSES * WIDTH + CLASSES
        assert logged(elsewhere / "run")[0]["state_bytes_per_device"] < 3 * 4 * params / 2


# ------------------------------------------------------------ killed after a checkpoint, rerun
KILL_STEPS, KILL_CHECKPOINT_EVERY = 150, 10
KILL_FLAGS = [
    f"--config.model={PACKAGE}.nets:LinenNet",
    "--config.model_args.dropout=0.1",  # its masks, too, must repeat after the restart
    f"--config.num_train_steps={KILL_STEPS}",
    f"--config.eval_every={KILL_STEPS}",
    f"--config.checkpoint_every={KILL_CHECKPOINT_EVERY}",
    "--workdir=run",
]


def test_killed_after_a_checkpoint_and_rerun_is_bit_for_bit_the_uninterrupted_run(
    own_config, references, tmp_path
):
    """The config's own npz rows and LinenNet with dropout 0.1, under ddp on 8 devices: SIGKILL
    once a checkpoint is committed, then the same command in the same directory."""
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    for folder in (uninterrupted, interrupted):
        folder.mkdir()
    result = train_cli(own_config, uninterrupted, *KILL_FLAGS)
    assert result.returncode == 0, result.stderr[-3000:]
    # Dropout is on: step 1 (the same start and rows) differs from the run without it.
    assert logged(uninterrupted / "run")[0]["loss"] != pytest.approx(
        references["LinenNet"]["losses"][0], rel=1e-3
    )

    workdir = interrupted / "run"
    with open(tmp_path / "killed.log", "w") as log:
        process = subprocess.Popen(
            jddp_train(own_config, *KILL_FLAGS),
            cwd=interrupted,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(),
        )
    assert wait_until(
        process,
        lambda: committed_checkpoints(workdir) and logged_steps(workdir) > KILL_CHECKPOINT_EVERY,
    )
    process.kill()
    assert process.wait() == -signal.SIGKILL, "the run ended before it was killed"
    before = BeforeRerun(workdir)
    assert KILL_CHECKPOINT_EVERY <= before.resume_step < KILL_STEPS
    result = train_cli(own_config, interrupted, *KILL_FLAGS)
    assert result.returncode == 0, result.stderr[-3000:]
    before.assert_resumed(log_every=1)
    assert_same_run(workdir, uninterrupted / "run")  # metrics and final parameters, bitwise


# ----------------------------------------------------------------- building, in-process
def test_linen_nnx_and_function_models_build_with_their_arguments(importable):
    linen = models.create_model(f"{PACKAGE}.nets:LinenNet", 10, width=7)
    assert (type(linen).__name__, linen.num_outputs, linen.width) == ("LinenNet", 10, 7)
    padded = models.create_model(f"{PACKAGE}.nets:make_net", 10, num_outputs=16)
    assert (type(padded).__name__, padded.num_outputs, padded.width) == ("LinenNet", 16, 32)
    built = models.create_model(f"{PACKAGE}.nets:NnxNet", 10, seed=3, width=5)
    from own_nets.nets import NnxNet

    expected = NnxNet(10, rngs=nnx.Rngs(3), width=5)  # NNX: the config's seed, as the user would
    jax.tree.map(np.testing.assert_array_equal, nnx.state(built), nnx.state(expected))
    # Mesh fields only where the module declares them: NormNet gets the batch axes.
    norm = models.create_model(f"{PACKAGE}.nets:NormNet", 10, batch_axis_name=("fsdp",))
    assert norm.batch_axis_name == ("fsdp",)
    assert not hasattr(models.create_model(f"{PACKAGE}.nets:LinenNet", 10), "batch_axis_name")
    # Built-in names keep working.
    assert type(models.create_model("mlp", 10)).__name__ == "MLP"


@pytest.mark.parametrize(
    "name,model_args,words",
    [
        ("no_such_pkg.nets:Net", {}, ["no module named 'no_such_pkg'", "beside the config"]),
        (f"{PACKAGE}.nest:Net", {}, [f"'{PACKAGE}.nest'", "PYTHONPATH"]),
        (f"{PACKAGE}.nets:LinenNe", {}, ["has no 'LinenNe'", "did you mean LinenNet"]),
        (f"{PACKAGE}.nets:Plain", {}, ["class Plain", "not a flax.linen.Module"]),
        (f"{PACKAGE}.nets:NOT_A_MODEL", {}, ["object of type int", "not a Flax module class"]),
        (f"{PACKAGE}.nets:make_list", {}, ["returned list", "not a flax.linen.Module"]),
        (f"{PACKAGE}.nets:LinenNet", {"depth": 2}, ["no argument depth", "num_outputs, width"]),
        (f"{PACKAGE}.nets:NnxNet", {"rngs": 1}, ["sets rngs, which jddp sets itself"]),
        (f"{PACKAGE}.nets:LinenNet", {"num_outputs": 4}, ["num_outputs=4 is smaller", "10"]),
        (f"{PACKAGE}.nets:LinenNet", {"num_outputs": "ten"}, ["num_outputs='ten' is not an"]),
        (f"{PACKAGE}.nets:NeedsFeatures", {}, ["needs features", "model_args.features"]),
        (f"{PACKAGE}.nets:Picky", {"width": 3}, ["ValueError: width 3 must be even", "nets.py:"]),
        ("own nets:Net", {}, ["'package.module:Name'"]),
    ],
)
def test_each_mistake_is_one_config_error_line(importable, name, model_args, words):
    with pytest.raises(jddp.ConfigError) as error:
        models.create_model(name, 10, **model_args)
    assert_one_line(error, *words)


def test_mesh_features_the_model_lacks_are_one_line(importable, own_config):
    """Sequence parallelism asks for a model argument; a stage axis for a Pipelined stack (the
    pipeline engine's own check, before anything compiles or is written)."""
    with pytest.raises(jddp.ConfigError) as error:
        models.create_model(
            f"{PACKAGE}.nets:LinenNet", 10, tensor_axis="tensor", sequence_parallel=True
        )
    assert_one_line(error, "sequence_parallel argument", "set it to false")
    config = jddp.default_config()
    config.model = f"{PACKAGE}.nets:LinenNet"
    config.parallel.strategy, config.parallel.mesh = "zero3", "stage:2,fsdp:4"
    dataset = factory.dataset_spec(config)
    trainer = factory.build_trainer(config, dataset)
    with pytest.raises(jddp.ConfigError) as error:
        trainer.abstract_state(factory.sample_batch(config, dataset))
    assert_one_line(error, "stage axis", "Pipelined")


def test_a_bad_own_model_from_jddp_train_is_one_line_and_writes_nothing(own_config, tmp_path):
    result = train_cli(
        own_config, tmp_path, f"--config.model={PACKAGE}.nets:LinenNett", "--workdir=run"
    )
    assert_error_exit(result, "has no 'LinenNett'", "did you mean LinenNet")
    assert os.listdir(tmp_path) == []
