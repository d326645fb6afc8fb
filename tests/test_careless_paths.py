"""Careless paths, each one correct line that leaves the user's files alone: checkpoints restored
into another model (shapes, dtypes, parameters, optimizer, gradient compression) through
`jddp.restore`, `Checkpoints`, `jddp.fit` and the CLI move nothing (a checksum of every file);
partition rules that decide no parameter; a model argument changed on resume, shown against the
model's own default; an unreadable checkpoints directory; `checkpoint_every=0` on a workdir with
checkpoints; a global batch larger than the training set."""

import json
import logging
import os
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jddp
from jddp import data
from jddp.checkpoints.store import Checkpoints
from jddp.errors import ConfigError, ShapeError, WorkdirError
from jddp.parallel.rules import adapt_preset
from jddp.run.experiment import train_and_evaluate
from tests.commands_in_one_process import run_commands
from tests.helpers import (
    REPO,
    SMALL_FLAGS,
    assert_error_exit,
    assert_one_line,
    checkout_env,
    small_config,
    small_net_trainer,
    snapshot,
)
from tests.reference import make_batches, per_example_ce

DEVICES = 2  # every trainer here: the checkpoints' layout is not what these tests are about


class Net(nn.Module):
    """SmallNet's shape with knobs a careless user turns between runs."""

    width: int = 24
    param_dtype: str = "float32"
    use_bias: bool = True
    scale_shape: tuple = ()  # a scalar parameter, or an array of one

    @nn.compact
    def __call__(self, x):
        hidden = nn.Dense(self.width, use_bias=self.use_bias, param_dtype=self.param_dtype)
        x = nn.tanh(hidden(x.reshape(x.shape[0], -1)))
        scale = self.param("scale", nn.initializers.ones, self.scale_shape)
        return nn.Dense(5)(x) * scale


def trainer_of(model=None, optimizer=None, **kwargs):
    return jddp.Trainer(
        model or Net(),
        per_example_ce,
        optimizer or optax.adam(1e-3),
        devices=jax.devices()[:DEVICES],
        **kwargs,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A `jddp.save` directory holding two checkpoints (steps 1 and 2) of Net under Adam."""
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    trainer, batches = trainer_of(), make_batches()
    state = trainer.init(seed=0, sample_batch=batches[0])
    for batch in batches[:2]:
        state, _ = trainer.step(state, batch)
        jddp.save(str(directory), state, trainer=trainer)
    return directory


@pytest.fixture
def checkpoints(saved, tmp_path):
    copy = tmp_path / "run" / "checkpoints"
    shutil.copytree(saved, copy)
    return copy


# (what changed, the trainer that restores, words of the one line)
OTHERS = {
    "narrower": (lambda: trainer_of(Net(width=16)), ["'params/Dense_0/bias'", "[24]", "[16]"]),
    "dtype": (
        lambda: trainer_of(Net(param_dtype="bfloat16")),
        ["'params/Dense_0/bias'", "float32[24]", "bfloat16[24]"],
    ),
    "missing-parameter": (
        lambda: trainer_of(Net(use_bias=False)),
        ["holds parameter 'params/Dense_0/bias'", "this state none"],
    ),
    "scalar-vs-array": (
        lambda: trainer_of(Net(scale_shape=(1,))),
        ["'params/scale'", "float32[]", "float32[1]"],
    ),
    "other-optimizer": (
        lambda: trainer_of(optimizer=optax.sgd(0.1, momentum=0.9)),
        ["optimizer state", "'opt_state/0", "optimizer that saved them"],
    ),
    # adamw keeps Adam's arrays under the same paths, plus one more empty state: structure only
    "other-optimizer-structure": (
        lambda: trainer_of(optimizer=optax.adamw(1e-3)),
        ["optimizer state entry 'opt_state/2'", "optimizer that saved them"],
    ),
    "gradient-compression": (
        lambda: trainer_of(grad_compression="powersgd"),
        ["gradient compression state entry 'comm_state/", "grad_compression"],
    ),
}


@pytest.mark.parametrize("change", list(OTHERS))
def test_restoring_into_another_model_is_one_line_and_moves_nothing(checkpoints, change):
    make_trainer, words = OTHERS[change]
    trainer, sample = make_trainer(), make_batches()[0]
    before = snapshot(checkpoints.parent)
    with pytest.raises(ShapeError) as error:
        jddp.restore(str(checkpoints), trainer, sample)
    assert_one_line(error, *words, "left as they are")
    store = Checkpoints(str(checkpoints), every=1, max_to_keep=None)
    try:  # the store itself, without any check of the caller's
        with pytest.raises(ShapeError) as error:
            store.restore_latest(trainer.abstract_state(sample))
    finally:
        store.close()
    assert_one_line(error, *words)
    assert snapshot(checkpoints.parent) == before  # nothing moved, written or removed
    # and the checkpoints are as good as before: the model that saved them restores them
    assert jddp.restore(str(checkpoints), trainer_of(), sample).step == 2


def test_fit_on_a_workdir_of_another_model_is_one_line_and_moves_nothing(tmp_path):
    workdir, batches = tmp_path / "run", make_batches()
    options = {"num_steps": 2, "checkpoint_every": 1, "log_every": 1}
    jddp.fit(trainer_of(), batches, workdir=str(workdir), **options)
    before = snapshot(workdir)
    with pytest.raises(ShapeError) as error:
        jddp.fit(trainer_of(Net(width=16)), batches, workdir=str(workdir), **options)
    assert_one_line(error, "'params/Dense_0/bias'", "left as they are", "new workdir")
    assert snapshot(workdir) == before


# ----------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """The digits MLP trained to its end (checkpoints at 5 and 10) with no model_args set: its
    config holds none of the MLP's arguments, which take the module's defaults."""
    workdir = tmp_path_factory.mktemp("mlp") / "run"
    train_and_evaluate(small_config(model_args={}), str(workdir))
    return workdir


def test_a_model_argument_at_its_default_is_no_change_and_others_show_the_default(
    mlp_run, tmp_path
):
    workdir = tmp_path / "run"
    shutil.copytree(mlp_run, workdir)
    before = snapshot(workdir)
    # The MLP's own default, written out: the same run, already finished.
    train_and_evaluate(small_config(model_args={"hidden_sizes": (256, 256)}), str(workdir))
    assert snapshot(workdir) == before
    train = ["experiments.train", f"--workdir={workdir}", *SMALL_FLAGS]
    narrower = [*train, "--config.model_args.hidden_sizes=(64,)"]
    refused, allowed, off = run_commands(  # each refused: one process runs the three
        [
            narrower,
            [*narrower, "--config.allow_config_change=true"],
            [*train, "--config.checkpoint_every=0"],
        ]
    )
    assert_error_exit(refused, "model_args.hidden_sizes: [256, 256] -> [64]", "another config")
    assert_error_exit(allowed, "'params/head/kernel'", "left as they are", "--workdir")
    assert_error_exit(off, "holds checkpoints (steps 5, 10", "--config.checkpoint_every above 0")
    assert snapshot(workdir) == before


def test_checkpointing_off_on_a_workdir_with_checkpoints_is_refused_in_the_library(checkpoints):
    workdir = checkpoints.parent
    before = snapshot(workdir)
    with pytest.raises(WorkdirError) as error:
        jddp.fit(
            trainer_of(), make_batches(), workdir=str(workdir), num_steps=3, checkpoint_every=0
        )
    assert_one_line(error, "holds checkpoints (steps 1, 2", "checkpoint_every above 0")
    assert snapshot(workdir) == before


# ------------------------------------------------------------------ unreadable checkpoints
# Root reads any directory: the child runs as root without the capabilities that bypass
# permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), as an ordinary user would.
UNPRIVILEGED = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]

LIBRARY_ATTEMPTS = """
import json, sys
import jddp
from tests.test_careless_paths import trainer_of
from tests.reference import make_batches
workdir, batches, said = sys.argv[1], make_batches(), {}
for name, attempt in {
    "fit": lambda: jddp.fit(trainer_of(), batches, workdir=workdir, num_steps=3),
    "restore": lambda: jddp.restore(workdir, trainer_of(), batches[0]),
}.items():
    try:
        attempt()
        said[name] = "no error"
    except jddp.JddpError as e:
        said[name] = f"{type(e).__name__}: {e}"
print(json.dumps(said))
"""


def unprivileged():
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: no way to run a child that permissions stop")
    return UNPRIVILEGED


def test_an_unreadable_checkpoints_directory_is_one_line(checkpoints):
    prefix, workdir = unprivileged(), checkpoints.parent
    os.chmod(checkpoints, 0)
    try:
        before = snapshot(workdir)  # the folder's own entry only: its files cannot be listed
        library = subprocess.run(
            [*prefix, sys.executable, "-c", LIBRARY_ATTEMPTS, str(workdir)],
            cwd=REPO, capture_output=True, text=True, timeout=300, env=checkout_env(),
        )  # fmt: skip
        assert library.returncode == 0, library.stderr[-3000:]
        said = json.loads(library.stdout.strip().splitlines()[-1])
        cli = subprocess.run(
            [*prefix, sys.executable, "-m", "experiments.train", f"--workdir={workdir}"],
            cwd=REPO, capture_output=True, text=True, timeout=300, env=checkout_env(),
        )  # fmt: skip
    finally:
        os.chmod(checkpoints, 0o755)
    for line in said.values():
        assert line.startswith("CheckpointError: ") and "\n" not in line, said
    # A run needs to write there; a reader (restore) only to read.
    assert "cannot be read and written" in said["fit"] and "chmod u+rwx" in said["fit"], said
    assert "cannot be read by" in said["restore"] and "chmod u+rx" in said["restore"], said
    assert_error_exit(cli, "cannot be read and written", str(checkpoints), "--workdir")
    assert snapshot(workdir) == before


# --------------------------------------------------------------------- partition rules
def rules_trainer(rules):
    return small_net_trainer("zero3", DEVICES, rules=rules)


@pytest.mark.parametrize(
    "rules,words",
    [
        (
            [("Dense_0/kernal", "replicate")],
            ["('Dense_0/kernal', 'replicate') matches no parameter", "closest", "'Dense_0/kernel'"],
        ),
        (
            [("kernel", "replicate"), ("Dense_1/kernel", "fsdp")],
            [
                "('Dense_1/kernel', 'fsdp') decides no parameter",
                "'Dense_1/kernel'",
                "earlier rule ('kernel', 'replicate')",
            ],
        ),
        (("Dense_0/kernel", "replicate"), ["not a sequence of (regex, spec) pairs", "(('head"]),
        ([(0, "replicate")], ["(0, 'replicate') is not a (regex, spec) pair of strings"]),
    ],
    ids=["typo", "shadowed", "one-pair-unwrapped", "not-a-string"],
)
def test_a_rule_that_decides_no_parameter_or_is_malformed_is_one_line(rules, words):
    with pytest.raises(ConfigError) as error:
        rules_trainer(rules).init(seed=0, sample_batch=make_batches()[0])
    assert_one_line(error, *words)


def test_a_presets_rules_may_match_nothing(tmp_path):
    """GPT's preset names layers SmallNet lacks; fitted to the mesh, it is allowed (and the
    default rule lays the parameters out); the CLI refuses its own rule typo before writing."""
    from jddp.models.gpt import TENSOR_PARALLEL_RULES

    trainer = rules_trainer(())
    preset = adapt_preset(TENSOR_PARALLEL_RULES, trainer.device_mesh)
    rules_trainer(preset).abstract_state(make_batches()[0])
    config = small_config()
    config.parallel.strategy, config.parallel.rules = "zero3", (("hiden_0/kernel", "replicate"),)
    with pytest.raises(ConfigError) as error:
        train_and_evaluate(config, str(tmp_path / "run"))
    assert_one_line(error, "('hiden_0/kernel', 'replicate') matches no parameter", "'hidden_0/")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------ batch size
def test_a_global_batch_larger_than_the_training_set_warns_once(tmp_path, caplog):
    examples = [
        {"image": np.full((4, 3), i, np.float32), "label": np.int32(i % 5)} for i in range(20)
    ]
    batches = data.train_batches(examples, lambda batch, keys: batch, global_batch_size=32, seed=0)
    with caplog.at_level(logging.WARNING):
        jddp.fit(trainer_of(), batches, workdir=str(tmp_path / "run"), num_steps=2, log_every=1)
    said = [
        r.getMessage() for r in caplog.records if "larger than the training set" in r.getMessage()
    ]
    assert len(said) == 1 and "global_batch_size=32" in said[0] and "(20 examples)" in said[0]
    assert "at most 20" in said[0]
