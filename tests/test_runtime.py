"""Joining a job: settings from flags or the environment; real processes started with the
variables SLURM, Open MPI and a Kubernetes Indexed Job set; the cluster launchers parse."""

import os
import socket
import subprocess
import sys

import pytest
import yaml

from jddp.errors import ConfigError
from jddp.runtime import processes as runtime
from tests.helpers import REPO

PROBE = (
    "from jddp import runtime; launch = runtime.initialize(); import jax; "
    "print(launch.source, jax.process_index(), jax.process_count())"
)


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({}, runtime.Launch("single")),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, runtime.Launch("single")),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, runtime.Launch("slurm")),
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
    for port in range(low, high):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def run_pair(environs: list[dict]) -> list[str]:
    """The probe in two real processes with these extra variables; their last lines."""
    base = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE],
            cwd=REPO,
            env={**base, **environ},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for environ in environs
    ]
    outputs = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=120)
        finally:
            process.kill()
        assert process.returncode == 0, output
        outputs.append(output.strip().splitlines()[-1])
    return outputs


# JAX derives the coordinator port from the job id: 61440 + (SLURM job id mod 4096), and for
# Open MPI 61440 + (job id / 4096 mod 4096); pick ids whose port is free here.
def test_slurm_environment_starts_a_real_two_process_job():
    port = free_port_in(61440, 65536)
    environs = [
        {
            "SLURM_JOB_ID": str(port - 61440),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
        }
        for rank in range(2)
    ]
    assert run_pair(environs) == ["slurm 0 2", "slurm 1 2"]


def test_open_mpi_environment_starts_a_real_two_process_job():
    port = free_port_in(61440, 65536)
    uri = f"{(port - 61440) * 4096}.0;tcp://127.0.0.1:5000"
    environs = [
        {
            "OMPI_MCA_orte_hnp_uri": uri,
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        }
        for rank in range(2)
    ]
    assert run_pair(environs) == ["openmpi 0 2", "openmpi 1 2"]


def test_kubernetes_indexed_job_environment_starts_a_real_two_process_job():
    port = free_port_in(30000, 40000)
    environs = [
        {
            "JDDP_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JDDP_NUM_PROCESSES": "2",
            "JOB_COMPLETION_INDEX": str(rank),
        }
        for rank in range(2)
    ]
    assert run_pair(environs) == ["kubernetes 0 2", "kubernetes 1 2"]


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
