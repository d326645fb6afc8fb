"""Goodput (jddp/observe/goodput.py): the ledger on a fake clock against a tally the test keeps
itself, a real run whose saves are slowed by a known delay, and a real training process
SIGKILLed after a checkpoint and run again to the end."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest

import jddp
from jddp.errors import WorkdirError
from jddp.observe import goodput
from tests.helpers import (
    REPO,
    BeforeRerun,
    checkout_env,
    committed_checkpoints,
    metrics_lines,
    small_net_trainer,
    xla_flags,
)
from tests.reference import make_batches

# Durations that are exact in binary floating point: sums compare with ==.
STEP, BATCH, SAVE, RESTORE, LOG = 0.25, 0.125, 0.5, 1.0, 0.0625


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Run:
    """Drives a `Ledger` as the loop does, advancing a fake clock, and tallies by itself what
    each category must hold: the reference the ledger is checked against."""

    def __init__(self, workdir, clock: FakeClock, started_at: float, *, startup: float = 2.0):
        self.clock, self.expected = clock, dict.fromkeys(goodput.CATEGORIES, 0.0)
        clock.now = started_at + startup  # fit begins after imports and setup
        self.ledger = goodput.Ledger(str(workdir), started_at=started_at, clock=clock)
        self.expected["startup"] += startup
        self.step_seconds = {}  # step -> the productive seconds it took

    def spend(self, category: str, seconds: float) -> None:
        self.ledger.switch(category)
        self.clock.now += seconds
        self.expected[category] += seconds

    def restore_and_begin(self, step: int) -> None:
        if step:
            with self.ledger.timing("restore"):
                self.clock.now += RESTORE
            self.expected["restore"] += RESTORE
        self.ledger.begin(step)
        self.spend("other", LOG)

    def steps(self, first: int, last: int, *, checkpoints=(), compile_first=False) -> None:
        for step in range(first, last + 1):
            self.spend("data", BATCH)
            compiling = compile_first and step == first
            self.spend("compile" if compiling else "steps", STEP)
            if not compiling:
                self.step_seconds[step] = STEP
            self.ledger.step_done(step)
            self.spend("other", LOG)
            self.ledger.flush()  # log_every=1
            if step in checkpoints:
                self.spend("save", SAVE)
                self.ledger.checkpoint_saved(step)
                self.ledger.switch("other")


def assert_partition(summary: dict, wall: float) -> None:
    assert sum(summary["seconds"].values()) == pytest.approx(wall, abs=1e-9)
    assert summary["wall_sec"] == pytest.approx(wall, abs=1e-9)


def test_a_restart_moves_the_redone_steps_to_lost_and_the_parts_sum_to_the_wall(tmp_path):
    clock = FakeClock(0.0)
    first = Run(tmp_path, clock, started_at=100.0)
    first.restore_and_begin(0)
    first.steps(1, 25, checkpoints=(10, 20), compile_first=True)
    killed_at_last_flush = clock.now
    assert_partition(first.ledger.summary(), clock.now - 100.0)

    # SIGKILL: the next process starts 7 s after the last flush and restores step 20.
    second = Run(tmp_path, clock, started_at=killed_at_last_flush + 7.0)
    second.restore_and_begin(20)
    second.steps(21, 30, checkpoints=(30,), compile_first=True)
    summary = second.ledger.end()

    lost = sum(first.step_seconds[s] for s in range(21, 26))  # steps 21-25, done twice
    expected = {k: first.expected[k] + second.expected[k] for k in goodput.CATEGORIES}
    expected["steps"] -= lost
    expected["lost"] = lost
    expected["restart"] = 7.0
    assert summary["seconds"] == pytest.approx(expected, abs=1e-9)
    assert summary["lost_steps"] == 5
    assert (summary["starts"], summary["restarts"], summary["step"]) == (2, 1, 30)
    assert_partition(summary, clock.now - 100.0)
    assert summary["fraction"] == pytest.approx(expected["steps"] / (clock.now - 100.0))

    # What a library user reads back; the history keeps each start's own partition.
    document = goodput.read(str(tmp_path))
    assert {k: document[k] for k in goodput.SUMMARY_KEYS} == summary
    assert goodput.summary_of(str(tmp_path)) == summary
    one, two = document["history"]
    assert (one["first_step"], one["last_step"], one["lost_steps"]) == (0, 20, 5)
    assert (two["first_step"], two["last_step"], two["lost_steps"]) == (20, 30, 0)
    assert sum(one["seconds"].values()) == pytest.approx(killed_at_last_flush - 100.0)
    assert sum(two["seconds"].values()) == pytest.approx(clock.now - killed_at_last_flush)

    # A third start that restores the same checkpoint again loses steps 21-30 of the second.
    third = Run(tmp_path, clock, started_at=clock.now + 3.0)
    third.restore_and_begin(20)
    again = third.ledger.summary()
    assert again["lost_steps"] == 5 + 10
    assert again["seconds"]["lost"] == pytest.approx(lost + 9 * STEP)  # 21 compiled: not steps
    assert again["seconds"]["restart"] == pytest.approx(7.0 + 3.0)


def test_a_start_before_the_first_checkpoint_loses_every_earlier_step(tmp_path):
    clock = FakeClock(0.0)
    first = Run(tmp_path, clock, started_at=10.0)
    first.restore_and_begin(0)
    first.steps(1, 6, compile_first=True)
    second = Run(tmp_path, clock, started_at=clock.now + 1.0)
    second.restore_and_begin(0)
    summary = second.ledger.summary()
    assert summary["lost_steps"] == 6
    assert summary["seconds"]["lost"] == pytest.approx(5 * STEP)
    assert summary["seconds"]["steps"] == 0.0
    assert_partition(summary, clock.now - 10.0)


def test_rewind_within_a_start_counts_each_undone_step_once(tmp_path):
    clock = FakeClock(0.0)
    run = Run(tmp_path, clock, started_at=0.0, startup=1.0)
    run.restore_and_begin(0)
    run.steps(1, 8, checkpoints=(5,), compile_first=True)
    run.ledger.rewind(5)  # a rollback at step 8 to the checkpoint of step 5
    assert run.ledger.summary()["lost_steps"] == 3
    run.steps(6, 7)
    run.ledger.rewind(5)  # and again at step 7
    run.steps(6, 9, checkpoints=(9,))
    summary = run.ledger.end()
    assert summary["lost_steps"] == 3 + 2
    assert summary["seconds"]["lost"] == pytest.approx(5 * STEP)
    assert summary["seconds"]["steps"] == pytest.approx((4 + 4) * STEP)  # 2-5, then 6-9
    assert_partition(summary, clock.now)


def test_a_checkpoint_the_ledger_never_heard_of_is_interpolated(tmp_path):
    clock = FakeClock(0.0)
    first = Run(tmp_path, clock, started_at=0.0)
    first.restore_and_begin(0)
    first.steps(1, 10, checkpoints=(4,))
    second = Run(tmp_path, clock, started_at=clock.now)
    second.restore_and_begin(7)  # saved, but killed before goodput.json said so
    summary = second.ledger.summary()
    assert summary["lost_steps"] == 3
    assert summary["seconds"]["lost"] == pytest.approx(3 * STEP)


@pytest.mark.parametrize(
    "content", ["{not json", "[1, 2]", '{"version": 1, "history": [{"started_at": "x"}]}', ""]
)
def test_a_damaged_ledger_is_one_warning_and_a_new_ledger(tmp_path, caplog, content):
    path = tmp_path / goodput.FILE
    path.write_text(content)
    with pytest.raises(WorkdirError) as error:
        goodput.read(str(tmp_path))
    assert "\n" not in str(error.value) and str(path) in str(error.value)

    clock = FakeClock(0.0)
    run = Run(tmp_path, clock, started_at=0.0)
    with caplog.at_level(logging.WARNING):
        run.restore_and_begin(20)  # a resume, but the ledger of the starts before is gone
        run.steps(21, 22)
        run.ledger.end()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "starting a new goodput ledger" in warnings[0].getMessage()
    summary = goodput.read(str(tmp_path))
    assert (summary["starts"], summary["lost_steps"]) == (1, 0)
    assert_partition(summary, clock.now)


def test_the_summary_line():
    seconds = dict.fromkeys(goodput.CATEGORIES, 0.0) | {
        "steps": 52.1, "compile": 3.2, "save": 1.1, "data": 0.04, "lost": 2.0, "restart": 4.0,
    }  # fmt: skip
    summary = {"fraction": 0.8683, "wall_sec": 60.0, "seconds": seconds, "lost_steps": 10}
    assert goodput.summary_line(summary | {"starts": 2}) == (
        "goodput 87%: steps 52.1 s, compile 3.2 s, save 1.1 s, lost 2.0 s (10 steps redone), "
        "restart 4.0 s of 60.0 s wall over 2 starts"
    )
    fresh = summary | {"seconds": seconds | {"lost": 0.0, "restart": 0.0}, "lost_steps": 0}
    assert goodput.summary_line(fresh | {"starts": 1}).endswith(
        "save 1.1 s of 60.0 s wall over 1 start"
    )


# ------------------------------------------------------ a real run with a known slow save
SAVE_DELAY_SEC = 1.0


def test_a_slow_save_is_booked_as_save_not_as_steps(tmp_path, monkeypatch):
    """Each orbax save of a real `jddp.fit` run waits SAVE_DELAY_SEC before it starts (an
    injected fault, like a slow file system): the save category holds every such wait, and the
    steps category (ten small steps) holds less than one."""
    real_save, delayed = ocp.CheckpointManager.save, []

    def slow_save(manager, step, *args, **kwargs):
        time.sleep(SAVE_DELAY_SEC)
        delayed.append(step)
        return real_save(manager, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", slow_save)
    trainer = small_net_trainer(num_devices=1)
    jddp.fit(
        trainer, make_batches()[:10], workdir=str(tmp_path / "run"), num_steps=10,
        checkpoint_every=5, log_every=5,
    )  # fmt: skip
    assert sorted(delayed) == [5, 10]
    seconds = goodput.summary_of(str(tmp_path / "run"))["seconds"]
    assert seconds["save"] >= len(delayed) * SAVE_DELAY_SEC, seconds
    assert seconds["steps"] < SAVE_DELAY_SEC, seconds


# ------------------------------------------------------------------- a real run, killed
STEPS, CHECKPOINT_EVERY, KILL_AFTER = 300, 50, 60
FLAGS = [
    f"--config.num_train_steps={STEPS}",
    "--config.log_every=1",  # every step logged: the last logged step is the last one done
    f"--config.checkpoint_every={CHECKPOINT_EVERY}",
    f"--config.eval_every={STEPS}",
    "--config.warmup_steps=0",
]
DEADLINE_SEC = 180  # any one process is SIGKILLed past it


def start(workdir, logs, name: str):
    """The training command in the background, its stdout and stderr in `logs`/NAME.out, .err."""
    with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *FLAGS],
            cwd=REPO,
            stdout=out,
            stderr=err,
            env=checkout_env(XLA_FLAGS=xla_flags(2)),
        )


def last_logged_step(workdir) -> int:
    return max((json.loads(line)["step"] for line in metrics_lines(workdir)), default=0)


def kill_after_a_checkpoint(process, workdir) -> int:
    """SIGKILLs `process` once a checkpoint is committed and KILL_AFTER steps are logged, at a
    moment the workdir's files agree (not between goodput.json's update and the step's record,
    written microseconds apart); returns the last step logged before the kill."""
    deadline = time.monotonic() + DEADLINE_SEC
    while time.monotonic() < deadline and process.poll() is None:
        if committed_checkpoints(workdir) and last_logged_step(workdir) >= KILL_AFTER:
            process.send_signal(signal.SIGSTOP)
            logged = last_logged_step(workdir)
            with open(os.path.join(workdir, goodput.FILE)) as f:
                ledger_step = json.load(f)["history"][-1]["last_step"]
            if ledger_step == logged:
                process.kill()
                process.wait()
                return logged
            process.send_signal(signal.SIGCONT)
        time.sleep(0.002)  # a poll interval, not a synchronization
    process.kill()
    raise AssertionError(f"the run ended or ran past {DEADLINE_SEC} s before the kill")


def test_a_killed_and_rerun_training_accounts_for_its_whole_wall_time(tmp_path):
    workdir = str(tmp_path / "run")
    first_start = time.time()
    last_logged = kill_after_a_checkpoint(start(workdir, tmp_path, "first"), workdir)
    before = BeforeRerun(workdir)
    restored = before.resume_step
    assert 0 < restored < last_logged < STEPS, (restored, last_logged)

    rerun = start(workdir, tmp_path, "rerun")
    try:
        rerun.wait(timeout=DEADLINE_SEC)
    except subprocess.TimeoutExpired:
        rerun.kill()
        raise
    assert rerun.returncode == 0, (tmp_path / "rerun.err").read_text()[-3000:]
    before.assert_resumed(log_every=1)  # it did restore `restored`, and redid the steps after
    ended = os.path.getmtime(os.path.join(workdir, goodput.FILE))  # the ledger's last update

    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)["goodput"]
    seconds = summary["seconds"]
    assert set(seconds) == set(goodput.CATEGORIES)
    assert sum(seconds.values()) == pytest.approx(summary["wall_sec"], rel=1e-9)
    # The wall from the first process's start (this clock, just before it was spawned) to the
    # last update: the parts cover it to 1%, across the kill and the restart.
    assert summary["wall_sec"] == pytest.approx(ended - first_start, rel=0.01)
    assert summary["lost_steps"] == last_logged - restored
    assert (summary["starts"], summary["restarts"], summary["step"]) == (2, 1, STEPS)
    for name in ("startup", "restore", "compile", "steps", "save", "lost", "restart"):
        assert seconds[name] > 0, name
    assert 0 < summary["fraction"] < 1

    output = (tmp_path / "rerun.out").read_text().splitlines()
    assert output[-1].startswith("done: ") and output[-2] == goodput.summary_line(summary)
    assert f"({last_logged - restored} steps redone)" in output[-2]
    assert ", restart " in output[-2] and output[-2].endswith("wall over 2 starts")
    console = "\n".join([*output, (tmp_path / "rerun.err").read_text()])
    assert len(re.findall(r"goodput \d+%: ", console)) == 1  # the CLI's line, printed once

    records = [json.loads(line) for line in metrics_lines(workdir)]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(0 <= r["goodput"] < 1 for r in records)  # 0 at step 1: it compiles
    assert records[-1]["goodput"] > 0
    assert set(records[-1]["goodput_seconds"]) == set(goodput.CATEGORIES)
    assert not any("goodput_seconds" in r for r in records[:-1])
    # The first process's start, from /proc: after the test spawned it, within a second.
    history = goodput.read(workdir)["history"]
    assert first_start - 0.02 <= history[0]["started_at"] < first_start + 1.0
    assert history[0]["lost_steps"] == last_logged - restored
