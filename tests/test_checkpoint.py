"""Checkpoints: restore across strategies and device counts, fall back past damage, the NaN guard,
init_from and export, and one-line refusals that leave the user's files alone."""

import glob
import json
import logging
import os

import jax
import numpy as np
import pytest

from jddp import data
from jddp.checkpoints.weights import load_params
from jddp.errors import TrainingHalted
from jddp.run.experiment import train_and_evaluate
from tests.commands_in_one_process import run_commands
from tests.helpers import (
    BeforeRerun,
    assert_error_exit,
    save_and_restore,
    small_config,
    small_net_trainer,
    snapshot,
)
from tests.reference import (
    assert_trees_close,
    make_batches,
    optimizer_for,
    reference_training,
)


def make_trainer(strategy, num_devices, mesh=None, **kwargs):
    return small_net_trainer(strategy, num_devices, mesh, grad_accum_steps=2, **kwargs)


@pytest.mark.parametrize(
    "source,target",
    [
        (("ddp", 8, None), ("zero3", 4, None)),
        (("zero3", 8, None), ("ddp", 2, None)),
        (("zero1", 4, None), ("zero2", 8, None)),
        (("hybrid", 8, "data:2,fsdp:4"), ("zero3", 2, None)),
        (("auto", 8, None), ("ddp", 2, None)),
        (("zero2", 4, None), ("auto", 8, "data:2,fsdp:4")),
    ],
)
def test_restore_into_another_strategy_and_device_count(tmp_path, source, target):
    batches = make_batches()
    writer = make_trainer(*source)
    state = writer.init(seed=0, sample_batch=batches[0])
    initial = writer.host_state(state).params
    for batch in batches[:10]:
        state, _ = writer.step(state, batch)
    saved = writer.host_state(state)
    reader = make_trainer(*target)
    directory = str(tmp_path / "checkpoints")
    step, state, meta = save_and_restore(writer, state, reader, batches[0], directory)
    assert step == 10 and meta == {"data": None}
    assert state.params["Dense_0"]["kernel"].sharding.mesh.size == target[1]
    jax.tree.map(np.testing.assert_array_equal, reader.host_state(state), saved)  # exact
    for batch in batches[10:]:
        state, _ = reader.step(state, batch)
    expected, _ = reference_training(initial, optimizer_for(clip=True), batches)
    assert_trees_close(reader.host_state(state).params, expected)


# 30 steps with a warm-up, checkpoints at 10, 20 and 30, all three kept.
LONGER = {
    "num_train_steps": 30,
    "eval_every": 30,
    "checkpoint_every": 10,
    "warmup_steps": 5,
    "max_to_keep": 3,
}


def longer_config(**overrides):
    return small_config(**{**LONGER, **overrides})


def read_records(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    keep = {"step", "loss", "grad_norm", "accuracy", "learning_rate", "eval_loss"}
    return [{k: v for k, v in json.loads(line).items() if k in keep} for line in lines]


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_used(tmp_path, caplog, damage):
    workdir = tmp_path / "run"
    train_and_evaluate(longer_config(), str(workdir))
    first_run = read_records(workdir)
    # The array data (OCDBT's data files, under d/); metadata and the commit marker stay intact,
    # so the damage shows only when the arrays are read.
    data_files = glob.glob(str(workdir / "checkpoints/30/state/**/d/*"), recursive=True)
    assert len(data_files) >= 2, data_files
    for path in data_files:
        if damage == "truncated":
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        else:
            os.remove(path)
    before = BeforeRerun(workdir, resume_step=20)
    with caplog.at_level(logging.WARNING):
        train_and_evaluate(longer_config(), str(workdir))
    before.assert_resumed(log_every=5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("checkpoints/30 is damaged" in w for w in warnings), warnings
    assert glob.glob(str(workdir / "checkpoints_damaged" / "30-*" / "state"))  # kept, not deleted
    assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "20", "30"]
    assert read_records(workdir) == first_run  # resumed at 20, steps 25 and 30 logged again


class InjectNaN:
    """A grain iterator whose batch number `at` (0-based) has NaN images."""

    def __init__(self, iterator, at):
        self.iterator, self.at, self.index = iterator, at, 0

    def __next__(self):
        batch = next(self.iterator)
        self.index += 1
        if self.index - 1 == self.at:
            batch = {**batch, "image": np.full_like(batch["image"], np.nan)}
        return batch

    def get_state(self):
        return self.iterator.get_state()

    def set_state(self, state):
        self.iterator.set_state(state)

    def close(self):
        self.iterator.close()


class SkipBatch(InjectNaN):
    """A grain iterator without its batch number `at` (0-based)."""

    def __next__(self):
        if self.index == self.at:
            next(self.iterator)
        self.index += 1
        return next(self.iterator)


@pytest.fixture
def nan_at_step_16(monkeypatch):
    real = data.train_batches
    monkeypatch.setattr(data, "train_batches", lambda *a, **k: InjectNaN(real(*a, **k), at=15))


def test_nan_policy_halt_stops_and_keeps_the_last_good_checkpoint(tmp_path, nan_at_step_16):
    workdir = tmp_path / "run"
    with pytest.raises(TrainingHalted, match="non-finite by step 20.*nan_policy=skip"):
        train_and_evaluate(longer_config(checkpoint_every=5), str(workdir))
    assert sorted(map(int, os.listdir(workdir / "checkpoints"))) == [5, 10, 15]  # none after
    params = load_params(str(workdir / "checkpoints" / "15"))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    assert not (workdir / "export").exists()


def test_nan_policy_skip_drops_the_update_and_counts_it(tmp_path, nan_at_step_16):
    workdir = tmp_path / "run"
    summary = train_and_evaluate(longer_config(nan_policy="skip"), str(workdir))
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_steps"] for r in records] == [0, 0, 0, 1, 1, 1]
    assert all(np.isfinite(r["loss"]) for r in records if r["step"] != 20 - 4)
    assert summary["eval_accuracy"] > 0.85


def test_nan_policy_rollback_trains_as_if_the_batch_was_never_there(tmp_path, monkeypatch):
    """The NaN batch 16 comes right after the checkpoint at 15: the rolled-back run equals,
    bit for bit, a run whose data never held that batch (in its place, the one after it)."""
    real = data.train_batches
    config = longer_config(nan_policy="rollback", checkpoint_every=5)
    monkeypatch.setattr(data, "train_batches", lambda *a, **k: InjectNaN(real(*a, **k), at=15))
    train_and_evaluate(config, str(tmp_path / "rolled_back"))
    monkeypatch.setattr(data, "train_batches", lambda *a, **k: SkipBatch(real(*a, **k), at=15))
    train_and_evaluate(config, str(tmp_path / "never_there"))
    rolled_back, never_there = (read_records(tmp_path / n) for n in ("rolled_back", "never_there"))
    assert rolled_back == never_there
    jax.tree.map(
        np.testing.assert_array_equal,
        load_params(str(tmp_path / "rolled_back")),
        load_params(str(tmp_path / "never_there")),
    )
    records = [json.loads(x) for x in (tmp_path / "rolled_back" / "metrics.jsonl").open()]
    (note,) = [r["rollback"] for r in records if "rollback" in r]
    assert (note["from_step"], note["to_step"], note["skipped_batches"]) == (16, 15, [16, 16])


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_skipped_update_leaves_state_unchanged_on_every_device(strategy):
    trainer = make_trainer(strategy, 8, skip_nonfinite=True)
    good, bad = make_batches()[0], {**make_batches()[1]}
    bad["image"] = bad["image"].copy()
    bad["image"][3] = np.nan  # one example poisons the averaged gradient everywhere
    state = trainer.init(seed=0, sample_batch=good)
    state, _ = trainer.step(state, good)
    before = trainer.host_state(state)
    state, metrics = trainer.step(state, bad)
    after = trainer.host_state(state)
    assert not np.isfinite(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
    jax.tree.map(np.testing.assert_array_equal, after.opt_state, before.opt_state)
    assert (int(after.step), int(after.nonfinite_steps)) == (2, 1)
    for leaf in jax.tree.leaves(state.params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards if s.replica_id == 0]
        assert all(np.isfinite(s).all() for s in shards)
    state, _ = trainer.step(state, good)  # and training goes on
    assert int(trainer.host_state(state).nonfinite_steps) == 1


def test_export_equals_the_final_checkpoint_and_init_from_starts_there(tmp_path):
    first = tmp_path / "first"
    summary = train_and_evaluate(longer_config(), str(first))
    exported = load_params(str(first / "export"))
    jax.tree.map(
        np.testing.assert_array_equal, exported, load_params(str(first / "checkpoints/30"))
    )
    second = tmp_path / "second"
    config = longer_config(init_from=str(first), learning_rate=1e-12, warmup_steps=0)
    config.num_train_steps, config.eval_every = 1, 1
    again = train_and_evaluate(config, str(second))
    assert again["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-6)


FAST = ["--config.num_train_steps=10", "--config.checkpoint_every=5", "--config.warmup_steps=0"]


def test_init_from_nothing_or_another_model_and_its_workdir_are_refused_in_one_line(tmp_path):
    """init_from a folder that does not exist, or the CNN's run for the MLP; the MLP into the
    CNN's workdir, refused unless overridden, then refused as it cannot fit: each one line with
    exit code 2, nothing written, the CNN's run untouched. Two processes: the second starts
    after the CNN's run is on disk."""
    cnn = tmp_path / "cnn"
    result, made = run_commands(
        [
            [
                "experiments.train",
                f"--workdir={tmp_path / 'a'}",
                f"--config.init_from={tmp_path / 'nothing'}",
            ],
            [
                "experiments.train",
                f"--workdir={cnn}",
                "--config=experiments/configs/digits_cnn.py",
                *FAST,
            ],
        ]
    )
    assert_error_exit(result, "init_from", "does not exist")
    assert not (tmp_path / "a").exists()
    assert made.returncode == 0, made.stderr
    before = snapshot(cnn)
    mlp = ["experiments.train", *FAST]
    from_cnn, into_cnn, overridden = run_commands(
        [
            [*mlp, f"--workdir={tmp_path / 'b'}", f"--config.init_from={cnn}"],
            [*mlp, f"--workdir={cnn}"],
            [*mlp, f"--workdir={cnn}", "--config.allow_config_change=true"],
        ]
    )
    assert_error_exit(from_cnn, "parameter", "shape", "in init_from", "same model")
    assert_error_exit(into_cnn, "another config", "model: 'cnn' -> 'mlp'", "allow_config_change")
    assert_error_exit(overridden, "'params/", "another model")  # it cannot fit, says why
    assert snapshot(cnn) == before
