"""The hang watchdog on real training processes (tests/hang_worker.py hangs one on purpose in a
host callback for an hour): every process writes its threads' stacks, prints one line and exits,
also a process that hangs only because its peer does; a slow first step, a slow evaluation and
slow checkpoint saves raise no alarm. No assertion is timed: the hang outlasts the test, so an
exit with the watchdog's code and line is the watchdog's doing, however busy the machine."""

import os
import signal
import subprocess
import sys
import time

from tests.helpers import REPO, error_line, launch_command

TIMEOUT_S = 3  # --config.hang_timeout_s
# After the hang begins, a watchdog that never fires is SIGKILLed this long after (the hang itself
# lasts an hour): a bound that keeps a broken watchdog from stalling the suite, not a claim.
KILL_AFTER_S = 180
HARD_LIMIT_S = 240  # a run that has not hung by then is SIGKILLed
WORKER = ["-m", "tests.hang_worker", "--config.model=sleepy_mlp", "--config.warmup_steps=0"]
FLAGS = ["--config.num_train_steps=1000", "--config.log_every=5"]


def start(launcher, workdir, env, *flags) -> subprocess.Popen:
    return subprocess.Popen(
        [*launcher, sys.executable, *WORKER, f"--workdir={workdir}", *FLAGS, *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env, "JDDP_TEST_HANG_MARKER": str(workdir) + ".hung"},
        start_new_session=True,
    )


def run_until_hang_and_exit(process, workdir) -> tuple[int, str]:
    """Waits for the hang to begin, then for the exit (SIGKILL after KILL_AFTER_S)."""
    marker, deadline = str(workdir) + ".hung", time.monotonic() + HARD_LIMIT_S
    while not os.path.exists(marker) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        output, _ = process.communicate(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"the watchdog never fired (SIGKILLed):\n{output}") from None
    assert os.path.exists(marker), output
    return process.returncode, output


def assert_stacks(path, *words):
    text = open(path).read()
    assert "no training step finished" in text and "(most recent call first)" in text
    for word in words:
        assert word in text, (word, text[:3000])


def test_one_process_hang_is_reported_after_a_slow_first_step_eval_and_save(tmp_path):
    """8 devices: the first step, the evaluation at step 10 and the checkpoint save at step 10
    each take twice the timeout and raise no alarm; the hang in step 15 (the device call
    14 x 8) does."""
    workdir = tmp_path / "run"
    slow = str(2 * TIMEOUT_S)
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JDDP_TEST_SLOW_FIRST_S": slow,
        "JDDP_TEST_SLOW_EVAL_S": slow,
        "JDDP_TEST_SLOW_SAVE_S": slow,
        "JDDP_TEST_HANG_AT": str(14 * 8),
    }
    flags = [f"--config.hang_timeout_s={TIMEOUT_S}", "--config.eval_every=10"]
    process = start([], workdir, env, *flags, "--config.checkpoint_every=10")
    code, output = run_until_hang_and_exit(process, workdir)
    assert code == 3, output
    line = error_line(output)
    assert "no training step finished for" in line and "after step 14" in line, line
    assert "last dispatched: train step" in line and str(workdir / "hang-0.txt") in line, line
    assert os.path.isdir(workdir / "checkpoints" / "10")  # the slow save is done, no alarm
    assert_stacks(workdir / "hang-0.txt", "in _host_hook", "in train_and_evaluate")


def launched_hang(workdir, **env) -> str:
    """The output of two processes under `jddp-launch` whose process 1 hangs as `env` says;
    asserts that the launcher exits with the watchdog's code."""
    launcher = launch_command(2, 1)
    flags = [f"--config.hang_timeout_s={TIMEOUT_S}", "--config.checkpoint_every=0"]
    env = {**env, "JDDP_TEST_HANG_PROCESS": "1"}
    code, output = run_until_hang_and_exit(start(launcher, workdir, env, *flags), workdir)
    assert code == 3, output
    return output


def test_two_processes_both_report_when_one_hangs(tmp_path):
    """Process 1 sleeps in step 11; process 0 waits for it inside the gradient all-reduce.
    Both write their stacks and say so in one line; the launcher exits with their code."""
    workdir = tmp_path / "run"
    output = launched_hang(workdir, JDDP_TEST_HANG_AT="10")
    for process in (0, 1):
        line = error_line(output, f"[{process}] ")
        assert "no training step finished" in line and "after step 10" in line, line
        assert str(workdir / f"hang-{process}.txt") in line, line
    assert_stacks(workdir / "hang-1.txt", "in _host_hook")  # the sleeper
    assert_stacks(workdir / "hang-0.txt", "in train_and_evaluate")  # stuck in the collective
    # Both are in step 11, one inside it, one in its collective: the launcher says so, last.
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: hang: every process stopped after step 10: one is stuck"), last
    assert str(workdir / "hang-0.txt") in last and str(workdir / "hang-1.txt") in last, last


def test_the_launcher_names_the_process_that_fell_behind_and_no_traceback_reaches_the_user(
    tmp_path,
):
    """Process 1's loop sleeps when it logs step 5; process 0 goes on into step 6's all-reduce
    and waits there. The launcher's last line names process 1 and its stacks."""
    workdir = tmp_path / "run"
    output = launched_hang(workdir, JDDP_TEST_HANG_AFTER_LOG="5")
    last = output.strip().splitlines()[-1]
    assert last.startswith(
        "error: hang: process 1 of 2 had not reached train step 6, which the others had "
        f"(stacks: {workdir / 'hang-1.txt'})"
    ), last
    assert "run the same command to resume" in last, last
    assert_stacks(workdir / "hang-1.txt", "in sleepy")
    assert "Traceback" not in output, output
