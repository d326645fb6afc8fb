"""Own models from the config: `config.model = "package.module:Name"` names a Linen or NNX class
or a function in a user package written outside jddp, beside the config file. Built in-process
(every mistake one ConfigError line), and trained by the installed `jddp-train` started from
another directory under ddp, zero3 and a tensor mesh with the config's own rules: every step's
loss equals a plain single-device optax loop written here."""

import json
import os
import subprocess
import textwrap

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp import data, models
from jddp.run import factory
from tests.helpers import REPO, assert_error_exit, assert_one_line

JDDP_TRAIN = os.path.join(REPO, ".venv", "bin", "jddp-train")
PACKAGE = "own_nets"  # the user's package, beside the config file
STEPS, GLOBAL_BATCH, LEARNING_RATE, WIDTH = 6, 32, 1e-2, 24
# The config's own tensor layout for LinenNet: Megatron's column split of fc, row split of head.
OWN_RULES = (("fc/kernel", "fsdp,tensor"), ("fc/bias", "tensor"), ("head/kernel", "tensor,fsdp"))

NETS = """
import flax.linen as nn
from flax import nnx


class LinenNet(nn.Module):
    num_outputs: int
    width: int = 32

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.width, name="fc")(x.reshape(x.shape[0], -1)))
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
    config.global_batch_size = {batch}
    config.num_train_steps = {steps}
    config.learning_rate = {lr}
    config.log_every = 1
    config.eval_every = {steps}
    config.checkpoint_every = 0
    return config
"""


def write_user_package(folder) -> str:
    """The user's package and config file in `folder`; returns the config file's path."""
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
                package=PACKAGE, width=WIDTH, batch=GLOBAL_BATCH, steps=STEPS, lr=LEARNING_RATE
            )
        )
    return path


@pytest.fixture(scope="module")
def own_config(tmp_path_factory):
    return write_user_package(tmp_path_factory.mktemp("user"))


@pytest.fixture
def importable(own_config, monkeypatch):
    """The user package importable in this process (as jddp-train makes the config's folder)."""
    monkeypatch.syspath_prepend(os.path.dirname(own_config))


def train_cli(config_path, cwd, *flags, env=None, timeout=300):
    """The installed `jddp-train` on `config_path`, started in `cwd`; children compile without
    LLVM optimization, as the test processes do."""
    return subprocess.run(
        [JDDP_TRAIN, f"--config={config_path}", *flags],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "true", **(env or {})},
    )


def logged(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------- the independent reference
def digits_batches() -> list[dict]:
    """The global batches jddp-train trains on: the digits dataset's order for seed 0."""
    splits = data.open_dataset(data.get_dataset("digits"), data.DataOptions())
    pipeline = data.train_batches(
        splits.train, splits.transform, global_batch_size=GLOBAL_BATCH, seed=0
    )
    try:
        return [next(pipeline) for _ in range(STEPS)]
    finally:
        pipeline.close()


def reference_losses(apply, params) -> list[float]:
    """One device, plain optax: Adam on the config's cosine schedule (weight decay 0), the mean
    cross-entropy over each whole global batch."""
    optimizer = optax.adam(optax.cosine_decay_schedule(LEARNING_RATE, STEPS))

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(params):
            logits = apply(params, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = optimizer.init(params), []
    for batch in digits_batches():
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses


def linen_reference() -> list[float]:
    """LinenNet from the initial parameters jddp draws for seed 0 (those of one device)."""
    from own_nets.nets import LinenNet

    model = LinenNet(num_outputs=10, width=WIDTH)
    sample = {"image": np.zeros((1, 8, 8, 1), np.float32), "label": np.zeros(1, np.int32)}
    one_device = jddp.Trainer(
        model, jddp.losses.softmax_cross_entropy, optax.sgd(0.0), devices=jax.devices()[:1]
    )
    initial = one_device.host_state(one_device.init(0, sample)).params
    return reference_losses(lambda p, x: model.apply({"params": p}, x), initial)


def nnx_reference() -> list[float]:
    """NnxNet as the user builds it with nnx.Rngs(seed 0)."""
    from own_nets.nets import NnxNet

    graphdef, params = nnx.split(NnxNet(10, rngs=nnx.Rngs(0), width=WIDTH))
    return reference_losses(lambda p, x: nnx.merge(graphdef, p)(x), params)


@pytest.fixture(scope="module")
def linen_losses(own_config):
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(os.path.dirname(own_config))
        return linen_reference()


# ------------------------------------------------------------------- jddp-train, 8 devices
@pytest.mark.parametrize(
    "model,flags",
    [
        ("LinenNet", ["--config.parallel.strategy=ddp"]),
        ("NnxNet", ["--config.parallel.strategy=zero3", "--config.parallel.min_shard_size=1"]),
        (
            "LinenNet",
            [
                "--config.parallel.strategy=zero3",
                "--config.parallel.mesh=data:2,fsdp:2,tensor:2",
                f"--config.parallel.rules={OWN_RULES!r}",
            ],
        ),
    ],
    ids=["linen-ddp", "nnx-zero3", "linen-tensor-mesh-own-rules"],
)
def test_jddp_train_from_another_directory_equals_one_device(
    own_config, linen_losses, tmp_path, model, flags
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = train_cli(
        own_config,
        elsewhere,
        f"--config.model={PACKAGE}.nets:{model}",
        "--workdir=run",  # relative: under the directory jddp-train started in
        *flags,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: eval accuracy" in result.stdout
    records = logged(elsewhere / "run")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    if model == "NnxNet":
        with pytest.MonkeyPatch.context() as patch:
            patch.syspath_prepend(os.path.dirname(own_config))
            expected = nnx_reference()
    else:
        expected = linen_losses
    np.testing.assert_allclose([r["loss"] for r in records], expected, rtol=1e-5)
    assert expected[-1] < expected[0] - 0.1  # it learns: the comparison is not of constants
    if any("tensor" in flag for flag in flags):
        # The own rules took effect: fc and head split over fsdp x tensor, so each device holds
        # well under half the replicated state (parameters and Adam's two moments, float32).
        params = WIDTH * 64 + WIDTH + 10 * WIDTH + 10
        assert records[0]["state_bytes_per_device"] < 3 * 4 * params / 2


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
