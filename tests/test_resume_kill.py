"""Kill a real training process (SIGKILL at several points, one of them inside an asynchronous
save; SIGTERM as schedulers preempt) and run the same command again: the rerun resumes from the
newest checkpoint, logs exactly what an uninterrupted run logs and ends with bitwise the same
parameters."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jddp.checkpoints.weights import load_params
from tests.helpers import (
    REPO,
    BeforeRerun,
    committed_checkpoints,
    launch_command,
    snapshot,
    xla_flags,
)

LOG_EVERY = 5
FLAGS = [
    "--config.num_train_steps=50",
    f"--config.log_every={LOG_EVERY}",
    "--config.eval_every=25",
    "--config.checkpoint_every=10",
    "--config.warmup_steps=5",
    "--config.global_batch_size=64",
    "--config.model_args.hidden_sizes=(1024,1024)",  # ~1.1M parameters
    "--config.peak_flops_per_device=1e12",  # MFU's denominator: no matmul timed at each start
]
# Speeds differ between runs, and the memory report is in a fresh start's first record only.
TIMING_KEYS = {
    "examples_per_sec",
    "tokens_per_sec",
    "flops_per_sec_per_device",
    "mfu",
    "state_bytes_per_device",
    "peak_bytes_per_device",
    "comm_bytes_per_step",
    "goodput",  # where the wall time went: differs between runs like the speeds
    "goodput_seconds",
}
DEADLINE_SEC = 240  # hard limit for any one process; it is SIGKILLed past it


def start(workdir, log_name, *more_flags, module=("experiments.train",)):
    log = open(os.path.join(os.path.dirname(workdir), log_name), "w")
    env = {**os.environ, "XLA_FLAGS": xla_flags(2)}
    return subprocess.Popen(
        [sys.executable, "-m", *module, f"--workdir={workdir}", *FLAGS, *more_flags],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


def wait_until(process, condition) -> bool:
    """Polls `condition` until it holds (True) or the process exits (False)."""
    deadline = time.monotonic() + DEADLINE_SEC
    while time.monotonic() < deadline:
        if condition():
            return True
        if process.poll() is not None:
            return condition()
        time.sleep(0.002)
    process.kill()
    raise AssertionError("training process ran past its deadline")


def finish(process) -> int:
    try:
        return process.wait(timeout=DEADLINE_SEC)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def logged_steps(workdir) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    steps = [json.loads(line)["step"] for line in open(path) if line.endswith("\n")]
    return max(steps, default=0)


def saving(workdir) -> bool:
    return bool(glob.glob(os.path.join(workdir, "checkpoints", "*tmp*")))


def records(workdir):
    lines = open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def assert_same_run(workdir, reference):
    assert records(workdir) == records(reference)  # same steps, bit-identical floats
    jax.tree.map(np.testing.assert_array_equal, load_params(workdir), load_params(reference))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("uninterrupted") / "run")
    assert finish(start(workdir, "uninterrupted.log")) == 0
    return workdir


def test_sigkill_anywhere_then_rerun_reproduces_the_run_bit_for_bit(tmp_path, uninterrupted):
    workdir = str(tmp_path / "run")
    # 1. Between checkpoints, after the first one.
    process = start(workdir, "kill1.log")
    assert wait_until(
        process, lambda: committed_checkpoints(workdir) and logged_steps(workdir) >= 15
    )
    process.kill()
    process.wait()
    # 2. Inside an asynchronous save: its first save stops before its commit, and waits there.
    before = BeforeRerun(workdir)
    marker = str(tmp_path / "stalled-save")
    process = start(workdir, "kill2.log", module=("tests.stalled_save", marker))
    assert wait_until(process, lambda: os.path.exists(marker)), "the save never started"
    process.kill()
    process.wait()
    stalled = int(open(marker).read())
    assert stalled > before.resume_step
    assert glob.glob(os.path.join(workdir, "checkpoints", f"{stalled}.*tmp*"))  # uncommitted
    assert stalled not in committed_checkpoints(workdir)
    before.assert_resumed(LOG_EVERY)
    # Run the same command to the end: it resumes from the checkpoint of before the interrupted
    # save. (A third kill, later between checkpoints, took the path of the first: one start
    # less.)
    before = BeforeRerun(workdir)
    assert finish(start(workdir, "final.log")) == 0
    before.assert_resumed(LOG_EVERY)
    assert not saving(workdir)  # the interrupted save was never taken for a checkpoint
    assert_same_run(workdir, uninterrupted)


def test_sigterm_saves_at_the_step_boundary_exits_cleanly_and_resumes(tmp_path, uninterrupted):
    workdir = str(tmp_path / "run")
    process = start(workdir, "term.log")
    assert wait_until(process, lambda: logged_steps(workdir) >= 20)
    process.send_signal(signal.SIGTERM)
    assert finish(process) == 0
    output = open(tmp_path / "term.log").read()
    (line,) = [x for x in output.splitlines() if x.startswith("preempted:")]
    step = int(line.split("step ")[1].split(";")[0])
    assert step >= 20 and step < 50
    before = BeforeRerun(workdir)
    assert before.resume_step == step  # the newest checkpoint is the one SIGTERM saved
    assert "Traceback" not in output
    assert finish(start(workdir, "resume.log")) == 0
    before.assert_resumed(LOG_EVERY)
    assert_same_run(workdir, uninterrupted)


# Two processes of one device each, started by the launcher, which forwards a SIGTERM to both
# as a scheduler signals every task of a job.
# (`start` runs `python -m MODULE...`: the launcher's command without its interpreter and `-m`.)
LAUNCHED = (*launch_command(2, 1)[2:], sys.executable, "-m", "experiments.train")


def test_sigterm_stops_every_process_at_the_same_step_and_they_save_it_together(
    tmp_path, uninterrupted
):
    workdir = str(tmp_path / "run")
    # As the Kubernetes manifest asks: every process ends with 75 after the save, not 0.
    process = start(workdir, "term.log", "--preempted_exit_code=75", module=LAUNCHED)
    assert wait_until(process, lambda: logged_steps(workdir) >= 20)
    process.send_signal(signal.SIGTERM)
    assert finish(process) == 75
    output = open(tmp_path / "term.log").read()
    saved = {}  # rank -> the steps it says it stopped at
    for line in output.splitlines():
        found = re.match(r"\[(\d)\] .*preempted: saved a checkpoint at step (\d+)", line)
        if found:
            saved.setdefault(int(found[1]), []).append(int(found[2]))
    assert sorted(saved) == [0, 1], output[-3000:]
    assert saved[0] == saved[1] and len(saved[0]) == 1, saved
    (step,) = saved[0]
    assert 20 <= step < 50
    before = BeforeRerun(workdir)
    assert before.resume_step == step  # the checkpoint both processes wrote, complete
    assert "Traceback" not in output
    assert finish(start(workdir, "resume.log", module=LAUNCHED)) == 0
    before.assert_resumed(LOG_EVERY)
    # Two processes of one device train what one process of two devices trains.
    ours, reference = records(workdir), records(uninterrupted)
    assert [r["step"] for r in ours] == [r["step"] for r in reference]
    np.testing.assert_allclose([r["loss"] for r in ours], [r["loss"] for r in reference], rtol=1e-5)


# PowerSGD's per-device error feedback: a checkpoint holds its mean, and the run that wrote it
# continues from that mean too (Trainer.consolidate), so a resumed run repeats it exactly.
POWERSGD = [
    "--config.parallel.grad_compression=powersgd",
    "--config.parallel.powersgd_rank=2",
    "--config.parallel.powersgd_start_step=5",
]


@pytest.fixture(scope="module")
def uninterrupted_powersgd(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("uninterrupted_powersgd") / "run")
    assert finish(start(workdir, "uninterrupted.log", *POWERSGD)) == 0
    return workdir


def test_sigkill_with_powersgd_then_rerun_reproduces_the_run_bit_for_bit(
    tmp_path, uninterrupted_powersgd
):
    workdir = str(tmp_path / "run")
    process = start(workdir, "kill.log", *POWERSGD)
    assert wait_until(
        process, lambda: committed_checkpoints(workdir) and logged_steps(workdir) >= 15
    )
    process.kill()
    process.wait()
    before = BeforeRerun(workdir)
    assert before.resume_step > 0, "killed before the first checkpoint"
    assert finish(start(workdir, "final.log", *POWERSGD)) == 0
    before.assert_resumed(LOG_EVERY)
    assert_same_run(workdir, uninterrupted_powersgd)


def test_resuming_powersgd_checkpoints_without_powersgd_is_refused_in_one_line(
    tmp_path, uninterrupted_powersgd
):
    workdir = str(tmp_path / "run")
    shutil.copytree(uninterrupted_powersgd, workdir)
    before = snapshot(workdir)
    process = start(workdir, "plain.log")
    assert finish(process) == 2
    lines = open(os.path.join(tmp_path, "plain.log")).read().strip().splitlines()
    assert "Traceback" not in "".join(lines)
    assert "gradient compression state" in lines[-1], lines[-3:]
    assert "grad_compression='powersgd' -> 'none'" in lines[-1], lines[-1]
    assert snapshot(workdir) == before
