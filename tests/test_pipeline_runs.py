"""Pipelined runs beyond one layout: checkpoints move between pipelined (stacked layers) and
plain (per-layer) runs exactly, both ways; the experiment path logs the schedule and starts
from another layout's weights; and stages on different processes train what one process
trains."""

import functools
import json
import sys

import jax
import numpy as np
import pytest

from jddp.checkpoints.weights import load_params
from jddp.core import layer_stacks
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.run.experiment import train_and_evaluate
from tests.helpers import save_and_restore
from tests.reference import assert_trees_close
from tests.test_multiprocess import launch
from tests.tiny_gpt import gpt_trainer, reference_from, token_batches
from tests.tiny_gpt_config import gpt_config

LAYERS, BATCH = 4, 32


@functools.cache  # one trainer (and its compiled steps) per layout for the whole module
def trainer_for(strategy, mesh, repeats=1):
    staged = mesh and "stage" in mesh
    pipeline = PipelineOptions(microbatches=4, repeats=repeats) if staged else None
    return gpt_trainer(strategy, mesh, layers=LAYERS, pipeline=pipeline)


@pytest.mark.parametrize(
    "source,target",
    [
        # per-layer to stacked (zero3 to zero2, fsdp:8 to stage:4,fsdp:2)
        (("zero3", "fsdp:8"), ("zero2", "stage:4,fsdp:2")),
        # interleaved (2 groups of one layer per stage, held in the stages' order) to unrolled
        # without stages: saved in the model's order, as a stack of repeats=1 is saved (the
        # stacked-to-per-layer restore of every pipelined checkpoint)
        (("zero1", "stage:2,fsdp:2", 2), ("ddp", None)),
        # stacked (repeats=1, saved as held) to interleaved on other stages
        (("zero2", "stage:4,fsdp:2"), ("zero1", "stage:2", 2)),
    ],
)
def test_checkpoints_move_between_pipelined_and_plain_layouts(tmp_path, source, target):
    """10 steps in one layout, saved, restored into the other: bit-identical state (converted
    between stacked and per-layer blocks), and 10 more steps end where 20 steps of one device
    end."""
    batches = token_batches(size=BATCH)
    writer = trainer_for(*source)
    state = writer.init(seed=0, sample_batch=batches[0])
    initial = writer.host_state(state).params
    for batch in batches[:10]:
        state, _ = writer.step(state, batch)
    saved = writer.host_state(state)
    reader = trainer_for(*target)
    _, state, _ = save_and_restore(writer, state, reader, batches[0], str(tmp_path / "ckpt"))
    stacked = "blocks" in reader.host_state(state).params
    same_layout = layer_stacks.to_stacked if stacked else layer_stacks.to_per_layer
    jax.tree.map(np.testing.assert_array_equal, reader.host_state(state), same_layout(saved))
    for batch in batches[10:]:
        state, _ = reader.step(state, batch)
    # One reference for every case: the unrolled model's (a stack is a layout, the same
    # parameters), from the writer's initial parameters in per-layer blocks.
    initial = layer_stacks.to_per_layer(initial)
    params, *_ = reference_from("learned", True, initial, LAYERS, batches)
    assert_trees_close(reader.host_state(state).params, same_layout(params))


def test_an_interleaved_state_evaluates_and_takes_weights_in_the_models_order():
    """stage:2 with 2 groups of one layer per stage, after 2 steps: its state (held in the
    stages' order), the same state in the model's order (`global_state`), the host parameters
    placed into it (`replace_state`), and one device given those parameters evaluate alike."""
    batches = token_batches(size=BATCH)
    trainer = trainer_for("zero1", "stage:2", 2)
    state = trainer.init(seed=0, sample_batch=batches[0])
    for batch in batches[:2]:
        state, _ = trainer.step(state, batch)
    params = trainer.host_state(state).params
    one = gpt_trainer("ddp", None, layers=LAYERS, devices=jax.devices()[:1])
    one_state = one.init(seed=1, sample_batch=batches[0])
    one_state = one.replace_state(one_state, params=layer_stacks.to_per_layer(params))
    expected = one.evaluate(one_state, batches[2:4])
    assert state.layer_order == (2, 2)
    for candidate in (
        state,
        trainer.global_state(state),
        trainer.replace_state(state, params=params),
    ):
        got = trainer.evaluate(candidate, batches[2:4])
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-6)


@pytest.fixture(scope="module")
def default_and_pipelined(tmp_path_factory):
    """A corpus, and the tiny GPT config with dropout 0.1 (2 layers, SGD, a record every step)
    trained on it as it is (ddp, layers unrolled: `default`) and on stage:2,fsdp:4 (layers
    stacked, 1F1B: `pipelined`), no checkpoints: the directory holding the three."""
    root = tmp_path_factory.mktemp("runs")
    text = root / "corpus.txt"
    text.write_text("".join(chr(32 + i * 11 % 90) for i in range(5_000)))
    pipeline = {"microbatches": 2, "schedule": "1f1b", "repeats": 1}
    for name, parallel in (
        ("default", {}),
        ("pipelined", dict(strategy="zero1", mesh="stage:2,fsdp:4", pipeline=pipeline)),
    ):
        config = gpt_config(str(text), **parallel)
        config.model_args.update(num_layers=2, dropout_rate=0.1)
        config.log_every, config.checkpoint_every = 1, 0
        # SGD: Adam would amplify rounding noise of near-zero gradients (see
        # test_stages_on_different_processes_train_what_one_process_trains)
        config.optimizer, config.learning_rate = "sgd", 0.5
        train_and_evaluate(config, str(root / name))
    return root


def test_experiment_logs_the_schedule_and_init_from_crosses_layouts(
    default_and_pipelined, tmp_path
):
    """The CLI path on stage:2,fsdp:2,tensor:2 (1F1B) starts from the default run's per-layer
    parameters (its export), and a plain ddp run from the pipelined run's stacked ones (its
    checkpoint), each exactly (a step of learning rate 1e-30 moves nothing but exact zeros);
    the pipelined run's first metrics record gives the schedule, micro-batches and bubble."""
    runs = default_and_pipelined
    text, default = str(runs / "corpus.txt"), runs / "default"
    # This test's own runs go to its own folder: the fixture's stay as the fixture made them.
    pipelined, ddp = tmp_path / "tensor_pipelined", tmp_path / "ddp_from_pipelined"
    pipeline = {"microbatches": 4, "schedule": "1f1b", "repeats": 1}
    config = gpt_config(
        text, str(default), strategy="zero1", mesh="stage:2,fsdp:2,tensor:2", pipeline=pipeline
    )
    config.model_args.num_layers = 2
    train_and_evaluate(config, str(pipelined))
    first = (pipelined / "metrics.jsonl").read_text().splitlines()[0]
    for key in ('"pipeline_schedule": "1f1b"', '"pipeline_microbatches": 4', '"pipeline_bubble"'):
        assert key in first
    # ddp reads this run's checkpoint; this run read the default run's export (it saved none)
    assert (pipelined / "checkpoints").is_dir() and not (default / "checkpoints").exists()
    config = gpt_config(text, str(pipelined), strategy="ddp")
    config.model_args.num_layers, config.checkpoint_every = 2, 0
    train_and_evaluate(config, str(ddp))
    for source, target in ((default, pipelined), (pipelined, ddp)):
        source_params, target_params = (load_params(str(d / "export")) for d in (source, target))
        as_target = (
            layer_stacks.to_stacked if "blocks" in target_params else layer_stacks.to_per_layer
        )
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-25),
            target_params,
            as_target(source_params),
        )


def test_stages_on_different_processes_train_what_one_process_trains(tmp_path):
    """The CLI on stage:2,data:-1 over 2 processes x 2 devices, one stage per process: both
    processes read every row of each global batch (their devices hold the same batch slices),
    and every step's record (loss, gradient norm, eval loss) and the exported parameters equal
    the same run's in this process (8 devices: data:4). SGD, not Adam: Adam turns the rounding
    noise of near-zero gradients (summed in another order) into steps of the learning rate's
    size (tests/tiny_gpt.py `adamw`), which the exported parameters would show."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(32 + i * 7 % 90) for i in range(3_000)))
    # A config file for the CLI; tests.tiny_gpt_config makes no JAX call at import, which
    # would come before jax.distributed starts.
    settings = f"{str(text)!r}, strategy='zero1', mesh='stage:2,data:-1'"
    config_file = tmp_path / "config.py"
    config_file.write_text(
        "from tests.tiny_gpt_config import gpt_config\n\n\ndef get_config():\n"
        f"    config = gpt_config({settings})\n"
        "    config.model_args.num_layers, config.checkpoint_every = 2, 0\n"
        "    config.log_every, config.optimizer, config.learning_rate = 1, 'sgd', 0.5\n"
        "    return config\n"
    )
    command = ["-m", "experiments.train", f"--config={config_file}"]
    code, output = launch(2, 2, sys.executable, *command, f"--workdir={tmp_path / 'two'}")
    assert code == 0, output
    config = gpt_config(str(text), strategy="zero1", mesh="stage:2,data:-1")
    config.model_args.num_layers, config.checkpoint_every, config.log_every = 2, 0, 1
    config.optimizer, config.learning_rate = "sgd", 0.5
    train_and_evaluate(config, str(tmp_path / "one"))

    def records(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        keep = ("step", "loss", "grad_norm", "eval_loss")
        return [{k: r[k] for k in keep if k in r} for r in map(json.loads, lines)]

    two, one = records("two"), records("one")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4]
    assert [sorted(r) for r in two] == [sorted(r) for r in one]
    assert "eval_loss" in one[-1]
    for got, expected in zip(two, one, strict=True):
        for key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-5), (got, expected)
    exported = [load_params(str(tmp_path / name / "export")) for name in ("two", "one")]
    assert_trees_close(*exported)


def test_a_pipelined_config_equals_the_configs_default_run_from_step_1(default_and_pipelined):
    """`scan_layers` is a layout, not another model: the tiny GPT config with dropout 0.1, run as
    it is (ddp, layers unrolled, no scan_layers set) and on stage:2,fsdp:4 (layers stacked, 1F1B),
    logs the same loss and gradient norm at every step from the first: the stacked layers start
    from the unrolled ones' parameters and draw the same dropout masks (before this, stacked
    layers were initialized differently: 2e-4 apart at step 1)."""
    runs = {}
    for name in ("default", "pipelined"):
        lines = (default_and_pipelined / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]
    assert [r[0] for r in runs["default"]] == [1, 2, 3, 4]
    np.testing.assert_allclose(runs["pipelined"], runs["default"], rtol=1e-5)
