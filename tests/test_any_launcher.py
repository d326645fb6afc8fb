"""A user's own script (tests/user_script.py: its model, its numpy data, `jddp.fit`, no jddp
internals) runs unchanged under every launcher and gives the same parameters: one process of 4
devices started by launch/slurm.sbatch (a stand-in `srun`), and 2 processes x 2 devices under
`jddp-launch`, killed and rerun by `--max_restarts`, equal at 1e-5. launch/kubernetes.yaml's two
pods join as one job, and stop in one line when their workdirs are not one directory.
`hybrid`'s default mesh groups devices by host (fsdp within a process on CPU), and a mesh whose
fsdp groups are one device is one warning naming the mesh to use."""

import os
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml

from jddp.errors import ConfigError, UsageError
from jddp.parallel.mesh import build_mesh, by_host
from jddp.parallel.zero import default_mesh_spec, unsharded_warning
from jddp.runtime.launch import free_port
from tests.helpers import REPO, checkout_env, launch_command, small_net_trainer, xla_flags

SCRIPT = os.path.join(REPO, "tests", "user_script.py")
HARD_TIMEOUT_S = 300


def run(command, env, cwd=REPO) -> str:
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=HARD_TIMEOUT_S
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def params(workdir) -> dict[str, np.ndarray]:
    with np.load(os.path.join(workdir, "params.npz")) as saved:
        return dict(saved)


def assert_params_close(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=name)


def run_sbatch(tmp_path, workdir) -> str:
    """launch/slurm.sbatch as SLURM runs it for a job of one task, given the user's command;
    the stand-in `srun` runs the command as that task, in its SLURM environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    env = checkout_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_NTASKS="1",
        SLURM_PROCID="0",
        SLURM_SUBMIT_DIR=REPO,
        XLA_FLAGS=xla_flags(4),
    )
    sbatch = os.path.join(REPO, "launch", "slurm.sbatch")
    return run(["bash", sbatch, sys.executable, SCRIPT, str(workdir)], env)


def kubernetes_pods(tmp_path, port: int) -> list[subprocess.Popen]:
    """The 2 pods of launch/kubernetes.yaml's Indexed Job with the user's script as their command
    and 1 device each: the manifest's environment (its coordinator's name mapped to this
    machine), JOB_COMPLETION_INDEX as the Job sets it, and each pod in a folder of its own, as
    pods without the shared volume would be."""
    with open(os.path.join(REPO, "launch", "kubernetes.yaml")) as f:
        job = [d for d in yaml.safe_load_all(f) if d["kind"] == "Job"][0]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    host, _, _ = env["JDDP_COORDINATOR_ADDRESS"].rpartition(":")
    assert host == f"{job['metadata']['name']}-0.{job['metadata']['name']}"  # pod 0's DNS name
    env["JDDP_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
    pods = []
    for index in range(int(env["JDDP_NUM_PROCESSES"])):
        folder = tmp_path / f"pod{index}"
        folder.mkdir()
        pod_env = checkout_env(**env, JOB_COMPLETION_INDEX=str(index), XLA_FLAGS=xla_flags(1))
        pods.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, "runs/a"],
                cwd=folder,
                env=pod_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return pods


def test_a_users_script_runs_unchanged_under_every_launcher_with_the_same_result(tmp_path):
    one = run_sbatch(tmp_path, tmp_path / "slurm")
    assert "mesh data:1,fsdp:4 processes [[0, 0, 0, 0]] shard (16, 4)" in one, one
    reference = params(tmp_path / "slurm")

    # 2 processes x 2 devices; process 1 dies (SIGKILL) drawing batch 11, past the step-8 save.
    marker = tmp_path / "killed"
    launcher = launch_command(2, 2)
    output = run(
        [*launcher[:-1], "--max_restarts=1", "--", "python", SCRIPT, str(tmp_path / "two")],
        checkout_env(USER_SCRIPT_KILL_MARKER=str(marker)),
    )
    assert marker.exists(), output
    assert "[launcher] process 1 of 2 failed (killed by SIGKILL)" in output, output
    assert "restart 1 of 1: starting the job again" in output, output
    # hybrid's default: fsdp over each process's own devices, replicas across processes.
    assert "[0] mesh data:2,fsdp:2 processes [[0, 0], [1, 1]] shard (32, 4)" in output, output
    assert not re.search(r"WorkdirError|Traceback|fsdp groups of one device", output), output
    assert_params_close(params(tmp_path / "two"), reference)


def test_kubernetes_pods_without_a_shared_workdir_stop_in_one_line(tmp_path):
    """The manifest's pods join as one job (hybrid's mesh spans both: its one-device warning on
    process 0), and find that their workdirs are not one directory."""
    outputs = []
    for pod in kubernetes_pods(tmp_path, free_port()):
        try:
            outputs.append(pod.communicate(timeout=HARD_TIMEOUT_S)[0])
        finally:
            pod.kill()
    unshared = (
        "WorkdirError: workdir 'runs/a' is not the same directory on every process: process 1 "
        "does not see the file process 0 created in it; put the workdir on storage every host "
        "mounts at the same path"
    )
    for output in outputs:
        assert unshared in output.splitlines()[-1], output
    # 1 device per process on CPU (each process its own host): hybrid warns, once, on process 0.
    assert [o.count("gives hybrid fsdp groups of one device") for o in outputs] == [1, 0], outputs
    assert "use 'fsdp:2'" in outputs[0]


# ----------------------------------------------------------------- meshes by host, in-process
def test_hybrid_groups_devices_by_host_whatever_the_processes_per_host():
    # 4 processes of 2 devices on 2 hosts, listed out of host order (SLURM's cyclic ranks).
    host_of_process = [0, 1, 0, 1]
    devices = [SimpleNamespace(id=i, process_index=i // 2) for i in range(8)]
    ordered, hosts = by_host(devices, host_of_process)
    assert hosts == 2 and default_mesh_spec("hybrid", hosts) == "data:2,fsdp:-1"
    assert [d.id for d in ordered] == [0, 1, 4, 5, 2, 3, 6, 7]  # host 0's four, then host 1's
    with pytest.raises(ConfigError, match=r"different numbers of devices \(\[2, 6\]\)"):
        by_host(devices, [0, 1, 1, 1])


def test_a_mesh_of_one_device_fsdp_groups_is_one_warning_naming_the_mesh_to_use():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        small_net_trainer("zero3", mesh="data:8,fsdp:1")
        small_net_trainer("hybrid", mesh="data:2,fsdp:4")  # sharded: no warning
        small_net_trainer("hybrid")  # one host: data:1,fsdp:8
    messages = [str(w.message) for w in caught if "fsdp groups" in str(w.message)]
    assert messages == [
        "parallel.mesh 'data:8,fsdp:1' gives zero3 fsdp groups of one device: nothing is "
        "sharded over fsdp and every one of the 8 replicas holds the whole optimizer state; use "
        "'fsdp:8' (fsdp within a host, replicas across hosts)"
    ]
    # On 2 hosts the mesh named keeps a replica per host; other axes stay as written.
    mesh = build_mesh("data:4,tensor:2", jax.devices())
    assert "use 'data:2,fsdp:2,tensor:2'" in unsharded_warning("zero1", mesh, hosts=2)


def test_a_script_that_used_jax_before_its_trainer_is_told_to_call_initialize(monkeypatch):
    jax.devices()  # the backend runs: too late for jax.distributed
    for name, value in {
        "JDDP_COORDINATOR_ADDRESS": "127.0.0.1:1",
        "JDDP_NUM_PROCESSES": "2",
        "JDDP_PROCESS_ID": "1",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError) as error:
        small_net_trainer("ddp")
    assert str(error.value) == (
        "this process is one of a job (jddp-launch), but JAX was used before jddp could join it "
        "(jax.distributed.initialize must come first); call jddp.initialize() at the top of "
        "your script, before any other JAX call"
    )
