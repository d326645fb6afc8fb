"""Several real processes on 127.0.0.1 (gloo collectives), each under a hard SIGKILL timeout:
the same training as one process and as one device, checkpoints that cross process counts,
a lost peer that stops the job, and the environments of SLURM, Open MPI and Kubernetes."""

import functools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import jddp
import jddp.runtime.job
import jddp.runtime.launch
import jddp.runtime.supervise
from experiments.configs import digits_mlp
from jddp import data
from jddp.checkpoints.store import Checkpoints
from jddp.checkpoints.weights import load_params
from jddp.core.tree_paths import nest_paths
from jddp.run import optim
from jddp.run.experiment import train_and_evaluate
from jddp.run.factory import build_trainer
from tests.helpers import PORT_TAKEN, REPO, launch_command, xla_flags
from tests.reference import (
    SmallNet,
    assert_trees_close,
    make_batches,
    optimizer_for,
    per_example_ce,
    reference_training,
)

HARD_TIMEOUT_SEC = 240


def worker_result(path):
    """(initial parameters, final parameters, losses) that tests/multiprocess_worker.py wrote."""
    result = np.load(path)

    def tree(prefix):
        return nest_paths(
            {k[len(prefix) :]: result[k] for k in result.files if k.startswith(prefix)}
        )

    return tree("initial/"), tree("final/"), result["losses"]


def launch(
    nproc, devices_per_proc, *command, timeout=HARD_TIMEOUT_SEC, env=None, cwd=REPO, program=None
):
    """`jddp-launch` (or `program`) in a subprocess in `cwd`; SIGKILLed (with its children) past
    `timeout`."""
    process = subprocess.Popen(
        [*launch_command(nproc, devices_per_proc, program), *command],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, output


@functools.cache  # per strategy: the cases differ only in how the workers split the devices
def one_process_and_one_device(strategy):
    """The workers' training (tests/multiprocess_worker.py) in this one process on 4 devices:
    (initial parameters, final parameters, losses), and (final parameters, losses) of the
    single-device reference loop from those initial parameters."""
    optimizer, batches = optimizer_for(clip=True), make_batches()
    options = {"min_shard_size": 1} if strategy != "ddp" else {}
    trainer = jddp.Trainer(
        SmallNet(),
        per_example_ce,
        optimizer,
        strategy=strategy,
        devices=jax.devices()[:4],
        grad_accum_steps=2,
        **options,
    )
    state = trainer.init(seed=0, sample_batch=batches[0])
    initial = trainer.host_state(state).params
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    one_process = (initial, trainer.host_state(state).params, losses)
    return one_process, reference_training(initial, optimizer, batches)


# Each strategy on 2 processes of 2 devices; zero3 also on 4 of 1 (4 processes, no device
# beside a process's own). ddp on one device per process: tests/test_resume_kill.py's 2 x 1
# against 1 x 2 (float32) and tests/test_compression.py's (compressed gradients).
@pytest.mark.parametrize(
    "strategy,nproc,devices_per_proc",
    [("ddp", 2, 2), ("zero3", 2, 2), ("zero3", 4, 1), ("auto", 2, 2)],
)
def test_processes_train_what_one_process_and_one_device_train(
    tmp_path, strategy, nproc, devices_per_proc
):
    out = str(tmp_path / "result.npz")
    code, output = launch(
        nproc, devices_per_proc, sys.executable, "-m", "tests.multiprocess_worker", strategy, out
    )
    assert code == 0, output
    initial, final, worker_losses = worker_result(out)
    # Process 0's coordinator listens on the address the launcher gave, loopback, only.
    if os.path.exists("/proc/net/tcp"):
        assert np.load(out)["coordinator_listens"].tolist() == ["127.0.0.1"]
    (one_initial, one_final, losses), (expected, expected_losses) = one_process_and_one_device(
        strategy
    )
    # The same initial parameters as one process with the same 4 devices, from which the
    # single-device reference loop starts.
    jax.tree.map(np.testing.assert_array_equal, one_initial, initial)
    assert_trees_close(final, expected)
    np.testing.assert_allclose(worker_losses, expected_losses, rtol=1e-5)
    assert_trees_close(final, one_final)
    np.testing.assert_allclose(worker_losses, losses, rtol=1e-5)


CLI = [
    sys.executable,
    "-m",
    "experiments.train",
    "--config.num_train_steps=20",
    "--config.log_every=5",
    "--config.eval_every=20",
    "--config.checkpoint_every=10",
    "--config.warmup_steps=0",
]
GIVEN_PEAK = "--config.peak_flops_per_device=1e12"  # MFU's denominator: no matmul timed


def test_cli_across_processes_logs_like_one_process_and_its_checkpoint_restores_in_one(tmp_path):
    code, output = launch(2, 2, *CLI, GIVEN_PEAK, f"--workdir={tmp_path / 'two'}")
    assert code == 0, output
    assert output.count("done: eval accuracy") == 1  # process 0 speaks for the job
    # The same config in this one process (its 8 devices; ddp's step is the global batch's mean
    # on any number), through the CLI's own function: what is compared is the records.
    config = digits_mlp.get_config()
    for flag in CLI[3:]:  # --config.KEY=INTEGER
        key, value = flag.removeprefix("--config.").split("=")
        config[key] = int(value)
    train_and_evaluate(config, str(tmp_path / "one"))

    def losses(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r.get("eval_loss", np.nan)) for r in map(json.loads, lines)]

    two, single = losses("two"), losses("one")
    assert [s for s, _, _ in two] == [s for s, _, _ in single] == [5, 10, 15, 20]
    np.testing.assert_allclose([x[1:] for x in two], [x[1:] for x in single], rtol=1e-5)
    exported = load_params(str(tmp_path / "two"))
    assert_trees_close(exported, load_params(str(tmp_path / "one")))

    # The checkpoint the two processes wrote, restored in this one process (8 devices).
    trainer = build_trainer(
        config, data.get_dataset("digits"), optim.learning_rate_schedule(config)
    )
    checkpoints = Checkpoints(str(tmp_path / "two" / "checkpoints"), every=10, max_to_keep=3)
    target = trainer.abstract_state({"image": np.zeros((1, 8, 8, 1), np.float32)})
    step, state, meta = checkpoints.restore_latest(target)
    checkpoints.close()
    assert (step, meta["processes"], meta["devices"]) == (20, 2, 4)
    jax.tree.map(np.testing.assert_array_equal, trainer.host_state(state).params, exported)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def rank_of(pid: int) -> int:
    """The process id the launcher gave its child `pid` (in its environment, not by PID order)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    return int(entries[b"JDDP_PROCESS_ID"])


def logged_step(workdir) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    lines = [line for line in open(path) if line.endswith("\n")]
    return json.loads(lines[-1])["step"] if lines else 0


def wait_for(condition, deadline):
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_the_launcher_names_the_process_killed_from_outside_whichever_exit_it_reads_first():
    """Process 0 is SIGKILLed and process 1 aborts (as a survivor of a lost peer does): read in
    either order, the failure is process 0's; an abort alone is the aborted process's."""
    children = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    survivor = subprocess.Popen(["sleep", "60"])
    watch = jddp.runtime.job.heartbeat.Watch()
    try:
        for child, sig in zip(children, (signal.SIGKILL, signal.SIGABRT), strict=True):
            child.send_signal(sig)
            child.wait()
        for order in ([1, 0], [0, 1]):
            exits = queue.Queue()
            for rank in order:
                exits.put((rank, children[rank].returncode, time.monotonic()))
            failed, _, _ = jddp.runtime.job._wait(
                children, exits, threading.Event(), lambda: False, watch
            )
            assert failed == 0, order
        exits = queue.Queue()
        exits.put((1, children[1].returncode, time.monotonic()))
        failed, _, _ = jddp.runtime.job._wait(
            [survivor, children[1]], exits, threading.Event(), lambda: False, watch
        )
        assert failed == 1
    finally:
        survivor.kill()
        survivor.wait()
        watch.close()


def test_a_lost_process_stops_the_launcher_and_the_survivor(tmp_path):
    workdir = str(tmp_path / "run")
    launcher = subprocess.Popen(
        [
            *launch_command(2, 1),
            *CLI[:3],
            "--config.num_train_steps=100000",
            "--config.log_every=10",
            "--config.checkpoint_every=0",
            GIVEN_PEAK,
            f"--workdir={workdir}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert wait_for(lambda: logged_step(workdir) >= 20, time.monotonic() + 180)
        ranks = {rank_of(pid): pid for pid in children_of(launcher.pid)}
        assert sorted(ranks) == [0, 1]
        workers = list(ranks.values())
        os.kill(ranks[1], signal.SIGKILL)
        output, _ = launcher.communicate(timeout=60)  # the job ends within 60 s
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGKILL
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)  # survivor gone too
    # The launcher's one line is the last; the survivor's traceback or abort dump is not shown.
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: process 1 of 2 failed (killed by SIGKILL); stopped the")
    assert "run the same command to resume" in last and "--max_restarts" in last, last
    for words in ("Traceback", "Connection reset", "Check failed", "Fatal Python error"):
        assert words not in output, output[-3000:]


@pytest.mark.parametrize("lost", [1, 0], ids=["process 1", "process 0 (the coordinator)"])
def test_without_a_launcher_the_survivor_ends_in_one_line_naming_the_lost_process(tmp_path, lost):
    """Each process started by hand; one dies with its host (its whole session is SIGKILLed):
    the other ends, within the heartbeat timeout, in one line naming it, not in JAX's abort."""
    workdir = str(tmp_path / "run")

    def start(port):
        return [
            subprocess.Popen(
                [
                    *CLI[:3],
                    "--config.num_train_steps=100000",
                    "--config.checkpoint_every=0",
                    "--config.log_every=10",
                    GIVEN_PEAK,
                    f"--workdir={workdir}",
                    f"--coordinator_address=127.0.0.1:{port}",
                    "--num_processes=2",
                    f"--process_id={rank}",
                    "--heartbeat_timeout_seconds=10",
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "XLA_FLAGS": xla_flags(1)},
                start_new_session=True,
            )
            for rank in range(2)
        ]

    processes = []
    try:
        # The port is free when picked; should another program take it before process 0's
        # coordinator binds it, process 0 says so and exits, and the pair starts again.
        for _ in range(3):
            processes = start(jddp.runtime.launch.free_port())
            assert wait_for(
                lambda first=processes[0]: logged_step(workdir) >= 10 or first.poll() is not None,
                time.monotonic() + 180,
            )
            if processes[0].poll() is None or PORT_TAKEN not in processes[0].communicate()[0]:
                break
            os.killpg(processes[1].pid, signal.SIGKILL)
            processes[1].communicate()
        assert logged_step(workdir) >= 10, processes[0].communicate(timeout=60)[0]
        survivor = processes[1 - lost]
        os.killpg(processes[lost].pid, signal.SIGKILL)
        output, _ = survivor.communicate(timeout=60)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert survivor.returncode == jddp.runtime.supervise.LOST_PEER_EXIT_CODE, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: lost process {lost} of 2"), output
    assert "run the same command again" in last and "resumes from the newest checkpoint" in last
    for abort in ("Fatal Python error", "Check failure stack trace", "Traceback"):
        assert abort not in output, output
    assert not re.search(r"^F\d{4} ", output, re.MULTILINE), output  # JAX's fatal log line
