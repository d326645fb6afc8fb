"""The hang watchdog on real training processes (tests/hang_worker.py hangs one on purpose, in a
host callback or in its loop, for an hour), and what jddp-launch says about a hang: every process
writes its threads' stacks, prints one line and exits, also a process that hangs only because its
peer does; a slow evaluation and slow checkpoint saves raise no alarm. No assertion is timed: the
hang outlasts the test, so an exit with the watchdog's code and line is the watchdog's doing,
however busy the machine. Then the bound's rule; the watchdog's thread on real JAX steps with
bounds in tenths of seconds (a slow first step and compile, evaluations); and a stopped process
under jddp-launch, which only the launcher can end."""

import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp

from jddp.runtime import failures
from jddp.runtime.job import Outcome
from jddp.runtime.watchdog import HangBound, HangWatchdog
from tests.helpers import REPO, error_line, launch_command, xla_flags

TIMEOUT_S = 3  # --config.hang_timeout_s
# Two processes: the sleeper first writes its step-5 record (reading the step's metrics, the
# learning rate), which on a loaded 2-core machine once took longer than 3 s, so that its watchdog
# fired before the sleep; the sleep must come first.
TWO_PROCESS_TIMEOUT_S = 10
# After the hang begins, a watchdog that never fires is SIGKILLed this long after (the hang itself
# lasts an hour): a bound that keeps a broken watchdog from stalling the suite, not a claim.
KILL_AFTER_S = 180
HARD_LIMIT_S = 240  # a run that has not hung by then is SIGKILLed
WORKER = ["-m", "tests.hang_worker", "--config.model=sleepy_mlp", "--config.warmup_steps=0"]
FLAGS = [
    "--config.num_train_steps=1000",
    "--config.log_every=5",
    "--config.peak_flops_per_device=1e12",  # MFU's denominator: no matmul timed at each start
]


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


def assert_stacks(path, *words, what="no training step finished"):
    text = open(path).read()
    assert what in text and "(most recent call first)" in text
    for word in words:
        assert word in text, (word, text[:3000])


def test_one_process_hang_is_reported_after_a_slow_eval_and_save(tmp_path):
    """8 devices: the evaluation at step 10 and the checkpoint save at step 10 each take 1.5
    times the step bound and raise no alarm (they have their own); the hang in step 15 (the
    device call 14 x 8) does. (A slow first step: the test on real steps below.)"""
    workdir = tmp_path / "run"
    slow = str(1.5 * TIMEOUT_S)
    env = {
        "XLA_FLAGS": xla_flags(8),
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


def test_two_processes_both_report_and_the_launcher_names_the_one_behind(tmp_path):
    """Process 1's loop sleeps when it logs step 5; process 0 goes on into step 6's all-reduce
    and waits there. Both watchdogs write their stacks (also the one that only waits for its
    peer); the launcher exits with their code, its last line naming process 1 and its stacks,
    and no traceback reaches the user."""
    workdir = tmp_path / "run"
    flags = [f"--config.hang_timeout_s={TWO_PROCESS_TIMEOUT_S}", "--config.checkpoint_every=0"]
    env = {"JDDP_TEST_HANG_AFTER_LOG": "5", "JDDP_TEST_HANG_PROCESS": "1"}
    process = start(launch_command(2, 1), workdir, env, *flags)
    code, output = run_until_hang_and_exit(process, workdir)
    assert code == 3, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(
        "error: hang: process 1 of 2 had not reached train step 6, which the others had "
        f"(stacks: {workdir / 'hang-1.txt'})"
    ), last
    assert "run the same command to resume" in last, last
    assert_stacks(workdir / "hang-1.txt", "in sleepy")  # the sleeper
    assert_stacks(workdir / "hang-0.txt", "in train_and_evaluate")  # stuck in the collective
    assert "Traceback" not in output, output


def hang_line(finished: int, dispatched: int, rank: int) -> str:
    return (
        f"error: no training step finished for 4 s after step {finished} (hang_timeout_s=3); "
        f"last dispatched: train step {dispatched}; every thread's stack is in /w/hang-{rank}.txt"
    )


def test_the_launcher_says_when_no_process_is_behind_and_names_one_that_never_reported():
    """Hangs inside a step (a device, a host callback: every process in the same step) cannot be
    pinned on one process; a process whose watchdog never ran is named as such."""
    same_step = Outcome({0: 3, 1: 3}, 0, {0: hang_line(10, 11, 0), 1: hang_line(10, 11, 1)}, False)
    assert failures.what_failed(same_step, 2) == (
        "hang: every process stopped after step 10: one is stuck inside the next step (on its "
        "devices or in a host callback) while the others wait for it in a collective (stacks: "
        "/w/hang-0.txt, /w/hang-1.txt)"
    )
    silent = Outcome({0: 3, 1: -9, 2: 3}, 0, {0: hang_line(7, 8, 0), 2: hang_line(7, 8, 2)}, False)
    assert failures.what_failed(silent, 3).startswith(
        "hang: process 1 of 3 never reported (stuck without its watchdog getting to run)"
    )


# ------------------------------------------------------------- the bound, and the thread itself
def test_the_adaptive_bound_outwaits_compiles_and_follows_the_median_step():
    rule = HangBound()  # the default: hang_timeout_s unset
    assert HangBound.from_setting(None) == rule
    # Before any steady step: the floor, or twice the first step (it compiles) when longer.
    assert rule.for_steps([], first_step_s=30.0) == 600
    assert rule.for_steps([], first_step_s=900.0) == 1800
    # Fast steps: the floor; slow ones: 20 x their median, which one slow step does not move.
    assert rule.for_steps([0.05] * 10, 30.0) == 600
    assert rule.for_steps([60.0] * 9 + [5000.0], 30.0) == 1200
    # Evaluations, saves and compiles: 3 x the step bound, at least 30 minutes.
    assert rule.for_pause(600) == 1800 and rule.for_pause(1200) == 3600
    # An explicit setting: a fixed step bound, or off.
    assert HangBound.from_setting(5).for_steps([60.0], 900.0) == 5
    assert HangBound.from_setting(0) is None


_SLEEP_STEP = jax.jit(
    lambda seconds: jax.pure_callback(
        lambda s: (time.sleep(float(s)), s)[1], jax.ShapeDtypeStruct((), jnp.float32), seconds
    )
)


def run_step(watchdog, step: int, seconds: float = 0.0) -> None:
    """A training step that takes `seconds` (on CPU its dispatch returns when it is done)."""
    watchdog.dispatching(step)
    watchdog.dispatched(step, _SLEEP_STEP(jnp.float32(seconds)))


def wait_for(fired: list) -> None:
    deadline = time.monotonic() + 60  # a broken watchdog never fires: no claim on the time
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fired, "the watchdog never fired"


def test_the_watchdog_spares_compiles_and_progressing_evaluations_and_bounds_the_rest(
    tmp_path, capsys
):
    """On real JAX steps, with bounds of seconds (a 1 s step floor: quick steps keep a wide margin
    on a loaded machine): a first step (compiling) and a trace
    far past the step bound, and an evaluation longer than its bound whose every batch is
    progress, raise no alarm; an evaluation that stops, and then a step far past the measured
    median, do, each with its line and the main thread's stack."""
    bound = HangBound(floor_s=1.0, pause_floor_s=2.0, pause_multiple=1.0)
    fired = []
    watchdog = HangWatchdog(bound, str(tmp_path), process_index=0, on_hang=fired.append)
    try:
        run_step(watchdog, 1, seconds=2.0)  # 2 x the floor: the first step is never a hang
        for step in (2, 3):
            run_step(watchdog, step)
        with watchdog.paused("evaluation at step 3") as pause:
            for _ in pause.each(range(4)):  # 3.2 s in all, under the 2 s bound per batch
                time.sleep(0.8)
        assert not fired
        with watchdog.paused("evaluation at step 3"):
            wait_for(fired)
    finally:
        watchdog.close()
    assert fired == [3]
    line = error_line(capsys.readouterr().err)
    assert "evaluation at step 3 made no progress for" in line and "after step 3" in line, line
    assert_stacks(tmp_path / "hang-0.txt", "in wait_for", what="evaluation at step 3 made no")

    fired = []
    watchdog = HangWatchdog(bound, str(tmp_path), process_index=0, on_hang=fired.append)
    try:
        for step in range(1, 6):  # quick steps: the bound is the 1 s floor
            run_step(watchdog, step)
        jax.jit(lambda x: (time.sleep(2.0), x + 1)[1])(1.0)  # a slow trace: compiling
        assert not fired
        watchdog.dispatching(6)  # and never dispatched: stuck
        wait_for(fired)
    finally:
        watchdog.close()
    line = error_line(capsys.readouterr().err)
    assert "no training step finished for" in line and "after step 5" in line, line
    assert "hang_timeout_s=auto" in line and "last dispatched: train step 6" in line, line


# ------------------------------------------------------- a process whose watchdog cannot run
# Beats as jddp's watchdog does (jddp/runtime/heartbeat.py, loaded without importing JAX): in the
# first start, process 1 stops itself (SIGSTOP); in the restart, both end at once.
STOPPING_CHILD = r"""
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("heartbeat", sys.argv[1])
heartbeat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heartbeat)
marker, rank = sys.argv[2], int(os.environ["JDDP_PROCESS_ID"])
with open(f"{marker}.{rank}.pid", "w") as f:
    f.write(str(os.getpid()))
beat = heartbeat.Beat.from_env()
beat.beat(2.0)
if os.path.exists(marker):
    beat.close()
    sys.exit(0)
if rank == 1:
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGSTOP)
for _ in range(600):
    beat.beat(2.0)
    time.sleep(0.1)
sys.exit(1)
"""


def test_the_launcher_names_a_stopped_process_and_restarts_the_job(tmp_path, capsys):
    from jddp.runtime import heartbeat, launch

    marker = str(tmp_path / "stopped")

    def kill_leftovers():  # only if the launcher never notices: a bound, not a claim
        for rank in (0, 1):
            try:
                os.kill(int(open(f"{marker}.{rank}.pid").read()), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    guard = threading.Timer(KILL_AFTER_S, kill_leftovers)
    guard.start()
    try:
        code = launch.main(
            ["--nproc=2", "--max_restarts=1", "--", sys.executable, "-c", STOPPING_CHILD,
             heartbeat.__file__, marker]
        )  # fmt: skip
    finally:
        guard.cancel()
    err = capsys.readouterr().err
    assert code == 0, err
    assert (
        "[launcher] hang: process 1 of 2 stopped making progress: no heartbeat from its watchdog "
        "for 2 s (its bound: 2 s); it is stopped (SIGSTOP, or Ctrl-Z); killed it"
    ) in err, err
    assert "restart 1 of 1" in err, err
