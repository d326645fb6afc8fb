"""`jddp-launch` keeps a job going: with --max_restarts it starts every process again after a
SIGKILL (at seeded random steps, once inside a checkpoint save) and the run ends with bitwise the
parameters and losses of an uninterrupted run; with --nproc=1:2 and --slots_file it shrinks to
one process while a slot is gone and grows back when it returns, equal to that run at 1e-5, and
says so in its log and in the metrics. Every launch runs under a hard SIGKILL timeout."""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jddp.checkpoints.weights import load_params
from tests.helpers import REPO, committed_checkpoints, launch_command
from tests.reference import assert_trees_close
from tests.test_multiprocess import children_of, rank_of

HARD_TIMEOUT_SEC = 300
STEPS = 48
FLAGS = [
    f"--config.num_train_steps={STEPS}",
    "--config.log_every=1",
    f"--config.eval_every={STEPS}",
    "--config.checkpoint_every=5",
    "--config.warmup_steps=0",
    "--config.global_batch_size=32",
    "--config.peak_flops_per_device=1e12",  # MFU's denominator: no matmul timed at each start
]
TRAIN = [sys.executable, "-m", "tests.slow_train", *FLAGS]  # time to act between steps


def start(*args, step_sleep_s=0.03) -> subprocess.Popen:
    """`args` in a new session; tests.slow_train's steps take at least `step_sleep_s`."""
    return subprocess.Popen(
        [*args],
        env={**os.environ, "JDDP_TEST_STEP_SLEEP_S": str(step_sleep_s)},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def launcher_command(*options, devices_per_proc=1):
    command = launch_command(2, devices_per_proc)
    return [*command[:-1], *options, "--"]  # the options before the launcher's `--`


def finish(process) -> str:
    try:
        output, _ = process.communicate(timeout=HARD_TIMEOUT_SEC)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return output


def records(workdir) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.endswith("\n")]


def last_step(workdir) -> int:
    return max((r["step"] for r in records(workdir)), default=0)


def wait_for(process, condition):
    deadline = time.monotonic() + HARD_TIMEOUT_SEC
    while time.monotonic() < deadline and process.poll() is None:
        if condition():
            return
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError(f"never happened; output:\n{process.communicate()[0][-3000:]}")


@contextlib.contextmanager
def killed_if_left(launcher):
    """The launcher and its children are SIGKILLed if the block leaves them running."""
    try:
        yield
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def workers(launcher, count: int) -> dict[int, int] | None:
    """{rank: pid} of the launcher's children once `count` of them run, else None."""
    try:
        ranks = {rank_of(pid): pid for pid in children_of(launcher.pid)}
    except (OSError, KeyError, ValueError):
        return None
    return ranks if len(ranks) == count else None


def losses(workdir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(workdir) if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("uninterrupted") / "run")
    process = start(*launcher_command(), *TRAIN, f"--workdir={workdir}", step_sleep_s=0)
    output = finish(process)
    assert process.returncode == 0, output[-3000:]
    return workdir


def test_max_restarts_brings_the_job_back_after_each_kill_bit_for_bit(tmp_path, uninterrupted):
    workdir, marker = str(tmp_path / "run"), str(tmp_path / "stalled-save")
    # tests.stalled_save: the first save stops before its commit until MARKER exists.
    stalling = [sys.executable, "-m", "tests.stalled_save", marker, *FLAGS]
    launcher = start(*launcher_command("--max_restarts=2"), *stalling, f"--workdir={workdir}")
    rng, killed, newest = random.Random(37), [], []

    def kill_a_process():
        """SIGKILLs either process, then waits for the next start's: by then every process of
        the killed start has exited and none of the next has saved, so the newest committed
        checkpoint is the one the next start must resume from."""
        pids = workers(launcher, 2)
        victim = rng.choice([0, 1])
        os.kill(pids[victim], signal.SIGKILL)
        killed.append(pids[victim])
        wait_for(
            launcher, lambda: (w := workers(launcher, 2)) and not set(w.values()) & set(killed)
        )
        newest.append(max(committed_checkpoints(workdir), default=None))

    with killed_if_left(launcher):
        # 1. Inside the first checkpoint save (process 0 writes it; either process is killed).
        wait_for(launcher, lambda: os.path.exists(marker))
        kill_a_process()
        # 2. At a random step past the furthest step the start before logged: one kill that
        # resumes from a committed checkpoint proves what more of them would (each restart is
        # a 2-process start, the cost of this test).
        target = min(STEPS - 2, last_step(workdir) + rng.randint(3, 8))
        wait_for(launcher, lambda: last_step(workdir) >= target)
        kill_a_process()
        output = finish(launcher)
    assert launcher.returncode == 0, output[-3000:]
    said = [line for line in output.splitlines() if line.startswith("[launcher]")]
    assert len(said) == 2 and all("(killed by SIGKILL)" in line for line in said), said
    assert [line.split("restart ")[1][:6] for line in said] == ["1 of 2", "2 of 2"]
    assert "Traceback" not in output, output[output.index("Traceback") - 2000 :][:5000]
    resumed = re.findall(r"\[0\] .*resuming from the checkpoint at step (\d+)", output)
    # The first restart starts afresh (the stalled save never committed); the others resume
    # from the newest checkpoint committed when they started.
    assert newest[0] is None and None not in newest[1:], newest
    assert [int(step) for step in resumed] == newest[1:], (resumed, newest)
    assert records(workdir) and losses(workdir) == losses(uninterrupted)  # bit for bit
    jax.tree.map(np.testing.assert_array_equal, load_params(workdir), load_params(uninterrupted))


def test_an_elastic_job_shrinks_while_a_slot_is_gone_and_grows_back(tmp_path, uninterrupted):
    workdir, slots = str(tmp_path / "run"), tmp_path / "slots"
    slots.write_text("2")
    options = ("--nproc=1:2", "--max_restarts=1", f"--slots_file={slots}")
    # Slower steps: the launcher looks at the slots once a second, and the run must go on.
    launcher = start(*launcher_command(*options), *TRAIN, f"--workdir={workdir}", step_sleep_s=0.1)
    with killed_if_left(launcher):
        wait_for(launcher, lambda: committed_checkpoints(workdir) and last_step(workdir) >= 8)
        slots.write_text("1")  # the slot goes, and its process with it
        before = workers(launcher, 2)
        os.kill(before[1], signal.SIGKILL)
        # Each next start's processes run once every process of the one before has exited, and
        # before they save: the newest committed checkpoint then is where each must resume.
        wait_for(launcher, lambda: (w := workers(launcher, 1)) and w[0] != before[0])
        newest = [max(committed_checkpoints(workdir))]
        shrunk = last_step(workdir)
        wait_for(launcher, lambda: last_step(workdir) >= shrunk + 6)  # one process trains on
        slots.write_text("2")  # it is back: the job saves, stops and starts on two
        wait_for(launcher, lambda: workers(launcher, 2))
        newest.append(max(committed_checkpoints(workdir)))
        output = finish(launcher)
    assert launcher.returncode == 0, output[-3000:]
    said = [line for line in output.splitlines() if line.startswith("[launcher]")]
    assert "process 1 of 2 failed (killed by SIGKILL)" in said[0], said
    assert "1 of 2 processes this time (were 2)" in said[1], said
    assert "more slots are free" in said[2] and "2 of 2 processes this time (were 1)" in said[3]
    resumed = re.findall(r"\[0\] .*resuming from the checkpoint at step (\d+)", output)
    assert [int(step) for step in resumed] == newest, (resumed, newest)
    assert newest[1] >= shrunk + 6  # the one-process start saved where it stopped
    # Each start on another device count says so in its first record: one device accumulates
    # two micro-batches of the 16 rows a device took at the start, the global batch stays 32.
    notes = [r["elastic"] for r in records(workdir) if "elastic" in r]
    assert [(n["devices"], n["grad_accum_steps"], n["micro_batch_per_device"]) for n in notes] == [
        (1, 2, 16),
        (2, 1, 16),
    ]
    ours, reference = losses(workdir), losses(uninterrupted)
    assert [s for s, _ in ours] == [s for s, _ in reference] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([x for _, x in ours], [x for _, x in reference], rtol=1e-5)
    assert_trees_close(load_params(workdir), load_params(uninterrupted))


def test_too_few_slots_for_too_long_is_one_line(tmp_path, capsys):
    import jddp.runtime.launch

    slots = tmp_path / "slots"
    slots.write_text("0")
    argv = ["--nproc=1:2", f"--slots_file={slots}", "--slots_timeout_s=0", "--", "true"]
    assert jddp.runtime.launch.main(argv) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"error: fewer than 1 processes may run (0 of 2 slots in {slots}) for 0 s; raise the "
        f"count in {slots} or lower --nproc's minimum, then run the same command to resume"
    )


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's, in this test process
def test_after_its_restarts_the_launcher_gives_up_in_one_line_with_the_failures_code(capsys):
    import jddp.runtime.launch

    failing = [sys.executable, "-c", "import sys; print('trying', flush=True); sys.exit(5)"]
    assert jddp.runtime.launch.main(["--nproc=1", "--max_restarts=1", "--", *failing]) == 5
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["[0] trying", "[0] trying"]  # started twice
    said = captured.err.strip().splitlines()
    assert said[0].startswith("[launcher] process 0 of 1 failed (exit code 5); stopped the")
    assert "restart 1 of 1" in said[0], said
    assert said[-1] == (
        "error: process 0 of 1 failed (exit code 5) after 1 restart; stopped the others; run "
        "the same command to resume from the newest checkpoint"
    )
