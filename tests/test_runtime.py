"""Joining a job: settings from flags or the environment; real processes started with the
variables SLURM, Open MPI and a Kubernetes Indexed Job set; the cluster launchers parse."""

import os
import random
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml

from jddp.errors import ConfigError
from jddp.runtime import launch
from jddp.runtime import processes as runtime
from tests.helpers import PORT_TAKEN, REPO, assert_one_line, launched, xla_flags

# Also counts the threads at the lowest priority: gloo's event-loop thread, put there by
# `initialize` (jddp/runtime/gloo_threads.py), and nothing else (the harness runs at nice 0).
PROBE = (
    "import os; from jddp.runtime import processes; launch = processes.initialize(); import jax; "
    "lowest = sum(os.getpriority(os.PRIO_PROCESS, int(t)) == 19 "
    "for t in os.listdir('/proc/self/task')); "
    "print(launch.source, jax.process_index(), jax.process_count(), lowest)"
)


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({}, runtime.Launch("single")),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, runtime.Launch("single")),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, runtime.Launch("single")),  # salloc's shell
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_NODELIST": "n[1-4]",
                "SLURM_NTASKS": "4",
                "SLURM_PROCID": "2",
            },
            runtime.Launch("slurm"),
        ),
        (
            {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:5", "OMPI_COMM_WORLD_SIZE": "2"},
            runtime.Launch("openmpi"),
        ),
        ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, runtime.Launch("tpu")),
        (
            {
                "JDDP_COORDINATOR_ADDRESS": "svc-0.svc:1234",
                "JDDP_NUM_PROCESSES": "4",
                "JOB_COMPLETION_INDEX": "3",
            },
            runtime.Launch("kubernetes", "svc-0.svc:1234", 4, 3),
        ),
        (
            {
                "JDDP_COORDINATOR_ADDRESS": "127.0.0.1:9",
                "JDDP_NUM_PROCESSES": "2",
                "JDDP_PROCESS_ID": "1",
                "SLURM_JOB_ID": "7",
                "SLURM_NTASKS": "2",
            },
            runtime.Launch("jddp-launch", "127.0.0.1:9", 2, 1),
        ),
    ],
)
def test_detect_reads_the_environment(environ, expected):
    assert runtime.detect(environ) == expected


def test_flags_win_and_go_together():
    assert runtime.detect(
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"},
        coordinator_address="h:1",
        num_processes=2,
        process_id=0,
    ) == runtime.Launch("flags", "h:1", 2, 0)
    with pytest.raises(ConfigError, match="go together"):
        runtime.detect({}, num_processes=2)
    with pytest.raises(ConfigError, match="JDDP_NUM_PROCESSES"):
        runtime.detect({"JDDP_COORDINATOR_ADDRESS": "h:1", "JDDP_PROCESS_ID": "0"})


def free_port_in(low: int, high: int) -> int:
    """A port in [low, high) that nothing listens on now (another program may take it before
    the coordinator binds it: `run_pair` then retries)."""
    ports = list(range(low, high))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def run_pair(environs_for, low: int, high: int, attempts: int = 3) -> list[str]:
    """The probe in two real processes with the extra variables `environs_for(port)` gives for a
    free port in [low, high); their last lines. A port taken between the pick and the
    coordinator's bind is picked again."""
    base = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    for _ in range(attempts):
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", PROBE],
                cwd=REPO,
                env={**base, **environ},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for environ in environs_for(free_port_in(low, high))
        ]
        outputs = []
        try:
            for process in processes:  # process 0 first: it runs the coordinator
                output, _ = process.communicate(timeout=120)
                if process.returncode != 0 and PORT_TAKEN in output:
                    break
                assert process.returncode == 0, output
                outputs.append(output.strip().splitlines()[-1])
            else:
                return outputs
        finally:
            for process in processes:
                process.kill()
                process.communicate()
    raise AssertionError(f"the coordinator's port was taken {attempts} times running")


# JAX derives the coordinator port from the job id: 61440 + (SLURM job id mod 4096), and for
# Open MPI 61440 + (job id / 4096 mod 4096); pick ids whose port is free here.
def test_slurm_environment_starts_a_real_two_process_job():
    def environs(port):
        return [
            {
                "SLURM_JOB_ID": str(port - 61440),
                "SLURM_STEP_NODELIST": "localhost",
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
            }
            for rank in range(2)
        ]

    assert run_pair(environs, 61440, 65536) == ["slurm 0 2 1", "slurm 1 2 1"]


def test_open_mpi_environment_starts_a_real_two_process_job():
    def environs(port):
        return [
            {
                "OMPI_MCA_orte_hnp_uri": f"{(port - 61440) * 4096}.0;tcp://127.0.0.1:5000",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_RANK": str(rank),
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            }
            for rank in range(2)
        ]

    assert run_pair(environs, 61440, 65536) == ["openmpi 0 2 1", "openmpi 1 2 1"]


def test_kubernetes_indexed_job_environment_starts_a_real_two_process_job():
    def environs(port):
        return [
            {
                "JDDP_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JDDP_NUM_PROCESSES": "2",
                "JOB_COMPLETION_INDEX": str(rank),
            }
            for rank in range(2)
        ]

    assert run_pair(environs, 30000, 40000) == ["kubernetes 0 2 1", "kubernetes 1 2 1"]


# ------------------------------------------------------------------------------- launcher
# A child that says when it is ready, then reports the signal it gets and exits 0; it dies on
# its own (SIGALRM) should no signal come.
SIGNALLED_CHILD = """
import os, signal, sys
def report(signum, _):
    print("got", signal.Signals(signum).name, flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, report)
signal.signal(signal.SIGTERM, report)
signal.alarm(120)
print("ready", flush=True)
while True:
    signal.pause()
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_launcher_forwards_sigint_and_sigterm_to_every_child(signum):
    with launched(SIGNALLED_CHILD) as launcher:
        ready = set()
        for line in launcher.stdout:  # ends early only if the launcher dies (hard timeout)
            if line.endswith("] ready\n"):
                ready.add(line.split("]")[0])
            if len(ready) == 2:
                break
        assert ready == {"[0", "[1"}, ready
        launcher.send_signal(signum)
        rest = launcher.stdout.read()
        assert launcher.wait() == 0, rest
    name = signal.Signals(signum).name
    assert sorted(rest.splitlines()) == [f"[0] got {name}", f"[1] got {name}"], rest


@pytest.mark.parametrize(
    "script", ["launch/slurm.sbatch", "launch/mpirun.sh", "launch/cpu_devices.sh"]
)
def test_shell_launchers_parse(script):
    result = subprocess.run(
        ["bash", "-n", os.path.join(REPO, script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_kubernetes_manifest_is_an_indexed_job_with_a_headless_service():
    with open(os.path.join(REPO, "launch", "kubernetes.yaml")) as f:
        service, job = yaml.safe_load_all(f)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    assert spec["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    env = {e["name"]: e["value"] for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert env["JDDP_NUM_PROCESSES"] == str(spec["parallelism"])
    assert env["JDDP_COORDINATOR_ADDRESS"].startswith(f"{job['metadata']['name']}-0.")


# ---------------------------------------------------------------- agreement across processes
def test_processes_that_disagree_with_process_0_are_named_in_one_line(monkeypatch):
    """`check_same_everywhere` (the config hash and initial-state checksum check) on 3 faked
    processes: equal digests pass, a process whose digest differs is named; equal values give
    equal digests and different values different ones."""
    from jax.experimental import multihost_utils

    sent, others = [], []

    def allgather(digest):
        sent.append(np.asarray(digest).copy())
        return np.stack([digest, digest, others[-1](np.asarray(digest))])

    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    others.append(lambda digest: digest)
    runtime.check_same_everywhere("config", {"lr": 0.1})
    others.append(lambda digest: digest ^ 1)
    with pytest.raises(ConfigError) as error:
        runtime.check_same_everywhere("config", {"lr": 0.1})
    assert_one_line(error, "processes [2] disagree with process 0 on the config")
    others.append(lambda digest: digest)
    for value in ({"lr": 0.1}, {"lr": 0.2}):
        runtime.check_same_everywhere("config", value)
    assert np.array_equal(sent[0], sent[1]) and np.array_equal(sent[0], sent[2])
    assert not np.array_equal(sent[2], sent[3])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT as Linux has it")
def test_the_launcher_holds_the_coordinator_port_for_the_job():
    """No other program can take the port between the launcher choosing it and process 0's
    coordinator binding it; the coordinator (gRPC, SO_REUSEPORT: an IPv6 socket on the
    IPv4-mapped loopback address, as `ss -ltn` shows it) binds beside the holder."""
    port, holder = launch.reserve_port()
    try:
        others = (
            (socket.AF_INET, "127.0.0.1"),
            (socket.AF_INET, "0.0.0.0"),
            (socket.AF_INET6, "::"),
        )
        for family, address in others:
            with socket.socket(family) as other, pytest.raises(OSError):
                other.bind((address, port))
        with socket.socket(socket.AF_INET6) as coordinator:
            coordinator.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            coordinator.bind(("::ffff:127.0.0.1", port))
            coordinator.listen()
    finally:
        holder.close()
