"""`nan_policy=rollback` (`fit(..., rollback=RollbackPolicy())`): a batch poisoned with NaN, or one
whose loss spikes, is undone: the newest checkpoint is restored and the batches since it are
skipped, on every process alike. The run then equals a plain single-device optax loop over the
data without those batches; a resume skips them again; rollbacks in a row stop in one line."""

import json
import os
import sys

import jax
import numpy as np
import pytest

import jddp
from jddp.checkpoints.peek import peek_latest
from jddp.errors import TrainingHalted
from tests.helpers import BeforeRerun, assert_one_line, committed_checkpoints
from tests.reference import (
    SmallNet,
    assert_trees_close,
    make_batches,
    optimizer_for,
    per_example_ce,
    reference_training,
)
from tests.test_multiprocess import launch, worker_result

STEPS = 14  # of the 20 reference batches: room for the skipped ones
EVERY = 4  # checkpoint_every


def poisoned(batches, *numbers, scale=np.nan, rows=slice(None)):
    """`batches` with the images of batch `number` (from 1) times `scale` in `rows`."""
    batches = [dict(batch) for batch in batches]
    for number in numbers:
        image = batches[number - 1]["image"].copy()
        image[rows] *= scale
        batches[number - 1]["image"] = image
    return batches


def without(batches, *spans):
    """The first STEPS of `batches` without the batches of each [first, last] span (numbered
    from 1)."""
    dropped = {n for first, last in spans for n in range(first, last + 1)}
    return [batch for n, batch in enumerate(batches, 1) if n not in dropped][:STEPS]


def metrics(workdir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def assert_equals_reference(trainer, state, workdir, batches, spans):
    initial = trainer.host_state(trainer.init(seed=0, sample_batch=batches[0])).params
    expected, losses = reference_training(
        initial, optimizer_for(clip=True), without(batches, *spans)
    )
    assert_trees_close(trainer.host_state(state).params, expected)
    logged = [r["loss"] for r in metrics(workdir) if "loss" in r]
    np.testing.assert_allclose(logged, losses, rtol=1e-5)
    assert [r["step"] for r in metrics(workdir) if "loss" in r] == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def trainer():
    return jddp.Trainer(
        SmallNet(), per_example_ce, optimizer_for(clip=True), devices=jax.devices()[:2]
    )


def fit(trainer, batches, workdir, num_steps=STEPS, **policy):
    return jddp.fit(
        trainer,
        batches,
        workdir=str(workdir),
        num_steps=num_steps,
        log_every=1,
        checkpoint_every=EVERY,
        rollback=jddp.RollbackPolicy(**policy),
    )


def test_a_nan_batch_is_rolled_back_and_skipped_and_a_resume_skips_it_too(tmp_path, trainer):
    batches = make_batches()
    data = poisoned(batches, 7)
    workdir = tmp_path / "run"
    fit(trainer, iter(data), workdir, num_steps=10)  # stops at step 10, the rollback behind it
    before = BeforeRerun(workdir)
    assert before.resume_step == 10
    state = fit(trainer, iter(data), workdir)  # resumes: a plain iterator is skipped by count
    before.assert_resumed(log_every=1)
    assert_equals_reference(trainer, state, workdir, batches, [[5, 7]])
    (note,) = [r["rollback"] for r in metrics(workdir) if "rollback" in r]
    assert note == {
        "from_step": 7,
        "to_step": 4,
        "reason": "non-finite loss or gradients",
        "skipped_batches": [5, 7],
        "in_a_row": 1,
    }
    meta = peek_latest(str(workdir / "checkpoints"))[0]
    assert meta["step"] == STEPS and meta["skipped_batches"] == [[5, 7]]


def test_a_loss_spike_is_rolled_back(tmp_path):
    """Batch 11's loss is 100 times the others' (its examples weigh 100 in this test's loss)."""
    batches = [
        batch | {"factor": np.ones(len(batch["label"]), np.float32)} for batch in make_batches()
    ]
    batches[10]["factor"] = batches[10]["factor"] * 100

    def weighted_ce(logits, batch):
        return per_example_ce(logits, batch) * batch["factor"]

    trainer = jddp.Trainer(
        SmallNet(), weighted_ce, optimizer_for(clip=True), devices=jax.devices()[:2]
    )
    state = fit(trainer, iter(batches), tmp_path, spike_factor=3, window=4)
    assert_equals_reference(trainer, state, tmp_path, batches, [[9, 11]])
    (note,) = [r["rollback"] for r in metrics(tmp_path) if "rollback" in r]
    assert note["reason"].startswith("loss spike (") and note["skipped_batches"] == [9, 11]


def test_rollbacks_in_a_row_stop_in_one_line_and_keep_the_checkpoints(tmp_path, trainer):
    data = poisoned(make_batches(), *range(6, 21))  # every batch after the first five
    with pytest.raises(TrainingHalted) as error:
        fit(trainer, iter(data), tmp_path, max_in_a_row=2)
    assert_one_line(error, "at step 5 after 2 rollbacks in a row to the checkpoint at step 4")
    assert sorted(committed_checkpoints(tmp_path)) == [0, 4]


def test_one_processs_poisoned_rows_roll_back_every_process(tmp_path):
    """Two processes; process 1's rows of batch 7 are NaN: both roll back at the same step,
    and the run equals the single-device loop over the data without batches 5-7."""
    out, workdir = str(tmp_path / "result.npz"), str(tmp_path / "run")
    code, output = launch(2, 1, sys.executable, "-m", "tests.rollback_worker", out, workdir)
    assert code == 0, output[-3000:]
    initial, final, losses = worker_result(out)
    expected, expected_losses = reference_training(
        initial, optimizer_for(clip=True), without(make_batches(), [5, 7])
    )
    assert_trees_close(final, expected)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    (note,) = [r["rollback"] for r in metrics(workdir) if "rollback" in r]
    assert (note["from_step"], note["to_step"], note["skipped_batches"]) == (7, 4, [5, 7])


@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"checkpoint_every": 0}, ["nan_policy=rollback restores checkpoints", "checkpoint_every"]),
        ({"spike_factor": 0.5}, ["spike_factor must be 0 (off) or above 1, got 0.5"]),
        ({"max_rollbacks": 0}, ["max_rollbacks", "--config.max_rollbacks"]),
    ],
)
def test_bad_rollback_settings_are_one_line(overrides, words):
    from jddp.errors import ConfigError
    from jddp.run import config as config_lib

    config = config_lib.default_config()
    config.nan_policy = "rollback"
    config.update(overrides)
    with pytest.raises(ConfigError) as error:
        config_lib.validate(config)
    assert_one_line(error, *words)
    with pytest.raises(ConfigError) as error:
        jddp.RollbackPolicy(window=0)
    assert_one_line(error, "window must be a positive integer, got 0")
