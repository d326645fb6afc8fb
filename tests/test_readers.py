"""Readers beside a live run: restoring, peeking, exporting's read and reading the metrics while
a run trains, saves and prunes change nothing in it (the run trains bit for bit as an undisturbed
one, every checkpoint intact). A failed read that is not damage moves nothing and is a
CheckpointUnreadable (exit code 75); real damage is set aside by the run holding the workdir,
and only by it, with no stray traceback from orbax's abandoned reads."""

import gc
import glob
import json
import logging
import os
import random
import shutil
import sys
import threading

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.checkpoints import damage, orbax_noise, weights
from jddp.checkpoints.folder import numbered
from jddp.checkpoints.peek import peek_latest
from jddp.errors import CheckpointUnreadable
from jddp.run.cli import exit_code
from tests.helpers import assert_one_line, fail_state_restores, snapshot

STEPS, EVERY, KEEP = 16, 2, 2
SEED = 49  # of the readers' schedule


class Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(256)(x)))  # 8 KiB: stored apart from the index


def batches():
    rng = np.random.default_rng(0)
    while True:
        x = rng.normal(size=(32, 8)).astype(np.float32)
        yield {"image": x, "label": x[:, :4].argmax(1).astype(np.int32)}


def trainer():
    return jddp.Trainer(Tiny(), jddp.losses.softmax_cross_entropy, optax.adam(1e-2))


SAMPLE = next(batches())


def train(workdir, on_step=lambda step: None, num_steps=STEPS) -> dict[int, dict]:
    """`jddp.fit` in `workdir` (a checkpoint every EVERY steps, KEEP kept); returns the host
    parameters after each step, and calls `on_step(step)` after each."""
    run, params = trainer(), {}

    def hook(step, state, metrics):
        params[step] = run.host_state(state).params
        on_step(step)

    jddp.fit(
        run, batches(), workdir=str(workdir), num_steps=num_steps, checkpoint_every=EVERY,
        max_to_keep=KEEP, log_every=1, hooks=[hook],
    )  # fmt: skip
    return params


def losses(workdir) -> list[float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """(workdir, parameters after each step) of a run nothing read beside."""
    workdir = tmp_path_factory.mktemp("undisturbed") / "run"
    return workdir, train(workdir)


# ------------------------------------------------------------------ readers beside a live run
def read_beside(workdir, action: str):
    """What one reader got: ("state", step, params), ("meta", step), ("metrics", records),
    ("none",) before the first checkpoint committed, or ("unreadable", message)."""
    try:
        if action == "restore":
            state = jddp.restore(str(workdir), trainer(), SAMPLE)
            if state is None:
                return ("none",)
            return "state", int(state.step), trainer().host_state(state).params
        if action == "peek":
            found = peek_latest(str(workdir / "checkpoints"))
            return ("none",) if found is None else ("meta", found[0]["step"])
        if action == "export":  # what jddp-export reads
            if not numbered(str(workdir / "checkpoints")):  # none committed yet
                return ("none",)
            found = weights.load_weights(str(workdir))
            step = int(found.source.split(os.sep)[-2])
            return "state", step, found.params
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
        return "metrics", [json.loads(line) for line in lines if line.endswith("}")]
    except CheckpointUnreadable as e:  # a step pruned while it was read: said in one line
        assert "\n" not in str(e) and exit_code(e) == 75, str(e)
        return "unreadable", str(e)


def test_readers_beside_a_live_run_change_nothing_in_it(tmp_path, undisturbed):
    reference_dir, reference = undisturbed
    workdir = tmp_path / "run"
    schedule = random.Random(SEED)
    actions = ("restore", "peek", "export", "metrics")
    plan = {step: schedule.choice(actions) for step in schedule.sample(range(3, STEPS), 8)}
    readers, results = [], []

    def start_reader(step):
        chosen = [plan[step]] if step in plan else []
        while schedule.random() < 0.3:  # and now and then one more at once
            chosen.append(schedule.choice(actions))
        for action in chosen:  # threads: each read overlaps the steps and saves that follow
            read = threading.Thread(target=lambda a=action: results.append(read_beside(workdir, a)))
            read.start()
            readers.append(read)

    params = train(workdir, start_reader)
    for read in readers:
        read.join(timeout=120)
    assert not any(read.is_alive() for read in readers)
    # The run trained as the undisturbed one, bit for bit, and kept its checkpoints whole.
    assert losses(workdir) == losses(reference_dir)
    for step in range(1, STEPS + 1):
        assert_same(params[step], reference[step])
    kept = sorted(os.listdir(workdir / "checkpoints"))
    assert kept == [str(STEPS - EVERY), str(STEPS)], kept  # no unfinished save, nothing pruned
    assert not os.path.exists(workdir / "checkpoints_damaged")
    for step in kept:
        assert damage.damage_in(str(workdir / "checkpoints" / step)) is None
        restored = jddp.restore(str(workdir), trainer(), SAMPLE, step=int(step))
        assert_same(trainer().host_state(restored).params, reference[int(step)])
    # Each reader read a complete checkpoint of the run, or said in one line that it could not.
    assert len(results) == len(readers) >= len(plan)
    for kind, *got in results:
        if kind == "state":
            assert_same(got[1], reference[got[0]])
        elif kind == "meta":
            assert got[0] % EVERY == 0 and got[0] <= STEPS
        elif kind == "metrics":
            assert [r["loss"] for r in got[0]] == losses(reference_dir)[: len(got[0])]
    assert sum(kind == "state" for kind, *_ in results) >= 1, results


# --------------------------------------------------- failures to read that are not damage
def newest_state_files(workdir) -> list[str]:
    """The data files of the newest checkpoint's arrays (and the nodes of each process's own
    index, which reads pass by), largest first."""
    found = glob.glob(str(workdir / "checkpoints" / str(STEPS) / "state/ocdbt.process_*/d/*"))
    return sorted(found, key=os.path.getsize, reverse=True)


@pytest.mark.parametrize("error", [TimeoutError("read timed out"), RuntimeError("INTERNAL: XLA")])
def test_a_read_error_that_is_not_damage_moves_nothing_and_is_retryable(
    tmp_path, undisturbed, monkeypatch, error
):
    workdir = tmp_path / "run"
    shutil.copytree(undisturbed[0], workdir)
    before = snapshot(workdir)
    fail_state_restores(monkeypatch, error)
    for read in (
        lambda: jddp.restore(str(workdir), trainer(), SAMPLE),  # a reader
        lambda: train(workdir, num_steps=STEPS + 2),  # the run holding the workdir
    ):
        with pytest.raises(CheckpointUnreadable) as raised:
            read()
        assert_one_line(raised, f"checkpoints/{STEPS}", type(error).__name__, "nothing was moved")
        assert exit_code(raised.value) == 75
        assert snapshot(workdir) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_this_user_may_not_read_is_not_damage(tmp_path, undisturbed):
    workdir = tmp_path / "run"
    shutil.copytree(undisturbed[0], workdir)
    os.chmod(newest_state_files(workdir)[0], 0)
    before = snapshot(workdir)
    with pytest.raises(CheckpointUnreadable) as raised:
        jddp.restore(str(workdir), trainer(), SAMPLE)
    assert_one_line(raised, f"checkpoints/{STEPS}", "nothing was moved")
    assert snapshot(workdir) == before


# ------------------------------------------------------------------------------ real damage
def test_real_damage_is_skipped_by_readers_and_set_aside_by_the_holder_without_tracebacks(
    tmp_path, undisturbed, monkeypatch, caplog
):
    """The newest checkpoint's data files cut to nothing. When one read fails, orbax abandons
    the reads tensorstore still has in flight, each reported (~60 lines) when it ends and the
    garbage collector reaches it; the library call waits for that, dropping them, before it
    returns: nothing is reported, and no read is left to report later. (Whether a read is still
    in flight depends on timing; with a larger model's checkpoint it often is.)"""
    workdir = tmp_path / "run"
    shutil.copytree(undisturbed[0], workdir)
    for path in newest_state_files(workdir):
        os.truncate(path, 0)
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    before = snapshot(workdir)
    with caplog.at_level(logging.WARNING):
        restored = jddp.restore(str(workdir), trainer(), SAMPLE)  # a reader: it moves nothing
    assert int(restored.step) == STEPS - EVERY
    assert_same(trainer().host_state(restored).params, undisturbed[1][STEPS - EVERY])
    assert snapshot(workdir) == before
    warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warned) == 1 and "shorter than" in warned[0] and "left where it is" in warned[0]

    params = train(workdir)  # the holder sets it aside, resumes before it, trains to the end
    assert sorted(params) == list(range(STEPS - EVERY + 1, STEPS + 1))
    assert_same(params[STEPS], undisturbed[1][STEPS])
    assert [p.split("-")[0] for p in os.listdir(workdir / "checkpoints_damaged")] == [str(STEPS)]
    gc.collect()
    assert reported == [] and orbax_noise.suspended_reads() == []
