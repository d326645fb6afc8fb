"""The cluster scripts keep a job going with the same command and workdir: launch/slurm.sbatch
run by bash with stand-in `srun`, `scancel` and `scontrol` (SIGTERM passed on to the tasks, then
a requeue; failures requeued up to JDDP_MAX_RESTARTS; exit codes 2 and 130 never), and
launch/kubernetes.yaml's failure policy applied as Kubernetes' Job controller documents it."""

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.helpers import REPO

SBATCH = os.path.join(REPO, "launch", "slurm.sbatch")
JOB_ID = "4242"
TRAIN_FLAGS = ["--config=experiments/configs/digits_mlp.py", "--workdir=runs/x"]
DEADLINE_S = 30  # for any one run of the script; each takes well under a second

# The stand-in for one training task. Its TASK_MODE: `wait_for_sigterm` (ready, then on SIGTERM
# a save that takes a moment, then exit 0), `sigkill` (killed), or an exit code.
TASK = r"""
import os, signal, sys, time

def log(line):
    with open(os.environ["EVENTS"], "a") as f:
        f.write(line + "\n")

mode = os.environ["TASK_MODE"]
if mode == "wait_for_sigterm":
    def save_and_stop(*_):
        log("task: got SIGTERM, saving")
        time.sleep(0.5)  # a save takes a while: a script that did not wait would requeue first
        log("task: saved")
        sys.exit(0)

    signal.signal(signal.SIGTERM, save_and_stop)
    signal.alarm(60)  # never outlives the test
    log("task: ready")
    with open(os.environ["TASK_PID"] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.environ["TASK_PID"] + ".tmp", os.environ["TASK_PID"])  # the ready signal
    while True:
        signal.pause()
elif mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
else:
    if mode == "2":
        print("error: --config.bogus is not a config key; see docs/configs.md", flush=True)
    sys.exit(int(mode))
"""

# SLURM's commands, as far as the script uses them: srun runs the task and ends with its exit
# code, or 128 + the signal that killed it; scancel --signal=TERM signals the job's tasks;
# scontrol records what it was asked.
FAKE_SRUN = """
import os, subprocess, sys
with open(os.environ["EVENTS"], "a") as f:
    f.write(" ".join(["srun", *sys.argv[1:]]) + "\\n")
code = subprocess.call([sys.executable, os.environ["TASK_FILE"]])
sys.exit(128 - code if code < 0 else code)
"""
FAKES = {
    "srun": f"#!{sys.executable}\n{FAKE_SRUN}",
    "scancel": '#!/usr/bin/env bash\necho "scancel $*" >> "$EVENTS"\n'
    'kill -TERM "$(cat "$TASK_PID")"\n',
    "scontrol": '#!/usr/bin/env bash\necho "scontrol $*" >> "$EVENTS"\n',
}


def run_sbatch(tmp_path, mode: str, *, preempt: bool = False, **variables: str):
    """launch/slurm.sbatch run by bash as SLURM would run it for job JOB_ID, with the stand-ins
    first on PATH and `variables` (None: unset) in its environment; SIGTERM to the script once
    the task is ready if `preempt`. Returns its exit code, output and the logged events."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "task.py").write_text(TASK)
    events, task_pid = tmp_path / "events", tmp_path / "task.pid"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "PYTHON": "python-never-run",  # the stand-in srun runs the task instead
        "TASK_FILE": str(tmp_path / "task.py"),
        "TASK_MODE": mode,
        "EVENTS": str(events),
        "TASK_PID": str(task_pid),
    }
    for name in ("SLURM_RESTART_COUNT", "JDDP_MAX_RESTARTS"):
        env.pop(name, None)
    env.update({k: v for k, v in variables.items() if v is not None})
    for name in [k for k, v in variables.items() if v is None]:
        env.pop(name, None)
    script = subprocess.Popen(
        ["bash", SBATCH, *TRAIN_FLAGS],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: killed whole if it overruns
    )
    try:
        if preempt:
            deadline = time.monotonic() + DEADLINE_S
            while not task_pid.exists():  # polled, with a deadline: the task's ready signal
                assert script.poll() is None, script.communicate()[0]
                assert time.monotonic() < deadline, "the task never became ready"
                time.sleep(0.02)
            script.send_signal(signal.SIGTERM)
        output, _ = script.communicate(timeout=DEADLINE_S)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.communicate()
    logged = events.read_text().splitlines() if events.exists() else []
    return script.returncode, output, logged


SRUN_LINE = f"srun python-never-run -m experiments.train {' '.join(TRAIN_FLAGS)}"
REQUEUE = f"scontrol requeue {JOB_ID}"


def test_sigterm_reaches_the_tasks_which_save_before_the_job_is_requeued(tmp_path):
    code, output, events = run_sbatch(tmp_path, "wait_for_sigterm", preempt=True)
    assert code == 0, output
    assert events == [
        SRUN_LINE,
        "task: ready",
        f"scancel --signal=TERM {JOB_ID}",
        "task: got SIGTERM, saving",
        "task: saved",
        REQUEUE,
    ], output
    assert output.splitlines()[-1] == (
        f"preempted: the tasks stopped (exit code 0); requeueing job {JOB_ID}: it resumes "
        "from the newest checkpoint"
    )


@pytest.mark.parametrize(
    "mode, restart_count, max_restarts, restart",
    [
        ("75", None, None, "restart 1 of 3"),  # a lost peer, first run (SLURM sets no count)
        ("3", "2", "3", "restart 3 of 3"),  # a hang, on the last restart allowed
        ("sigkill", "0", "1", "restart 1 of 1"),
    ],
)
def test_a_failure_requeues_while_restarts_remain(
    tmp_path, mode, restart_count, max_restarts, restart
):
    code, output, events = run_sbatch(
        tmp_path, mode, SLURM_RESTART_COUNT=restart_count, JDDP_MAX_RESTARTS=max_restarts
    )
    assert code == 0, output
    assert events == [SRUN_LINE, REQUEUE], output
    status = 137 if mode == "sigkill" else int(mode)
    assert output.splitlines() == [
        f"{restart}: the tasks failed (exit code {status}); requeueing job {JOB_ID}: it resumes "
        "from the newest checkpoint"
    ]


@pytest.mark.parametrize("mode, restarts", [("75", "3"), ("sigkill", "0")])
def test_out_of_restarts_the_job_ends_in_one_line_with_the_failures_code(tmp_path, mode, restarts):
    code, output, events = run_sbatch(
        tmp_path, mode, SLURM_RESTART_COUNT=restarts, JDDP_MAX_RESTARTS=restarts
    )
    status = 137 if mode == "sigkill" else int(mode)
    assert code == status, output
    assert events == [SRUN_LINE], output  # never requeued
    assert output.splitlines() == [
        f"error: the tasks failed (exit code {status}) after {restarts} restarts "
        f"(JDDP_MAX_RESTARTS={restarts}); not requeued: fix the cause above, then submit the "
        "same command again to resume from the newest checkpoint"
    ]


@pytest.mark.parametrize("mode", ["2", "130", "0"], ids=["mistake", "interrupted", "success"])
def test_a_mistake_an_interruption_or_success_is_never_requeued(tmp_path, mode):
    code, output, events = run_sbatch(tmp_path, mode, SLURM_RESTART_COUNT="0")
    assert code == int(mode), output
    assert events == [SRUN_LINE], output
    if mode == "2":  # the task's own line is the last, and the only one
        assert output.splitlines() == [
            "error: --config.bogus is not a config key; see docs/configs.md"
        ]
    else:
        assert output == ""


def test_mistakes_in_the_scripts_own_inputs_end_in_one_line_before_any_task(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    code, output, events = run_sbatch(tmp_path / "a", "0", JDDP_MAX_RESTARTS="three")
    assert (code, events) == (2, []), output
    assert output.splitlines() == [
        "error: JDDP_MAX_RESTARTS must be a whole number of restarts (0 or more), got 'three'"
    ]
    code, output, events = run_sbatch(tmp_path / "b", "0", SLURM_JOB_ID=None)
    assert (code, events) == (2, []), output
    assert output.splitlines() == [
        "error: launch/slurm.sbatch runs inside a SLURM job: submit it with sbatch (see its header)"
    ]


# ---------------------------------------------------------------- Kubernetes
def job_controller_action(job_spec, exit_code: int, conditions=()) -> str:
    """What Kubernetes' Job controller does with a failed pod of `job_spec` whose container
    `train` exited with `exit_code` and whose true conditions are `conditions`, as its docs say:
    the first podFailurePolicy rule that matches acts ("FailJob", "Ignore", ...); none: "Count"
    (against the backoff limit). Exit code 0 matches no exit-code rule."""
    for rule in job_spec.get("podFailurePolicy", {}).get("rules", []):
        if "onExitCodes" in rule:
            codes = rule["onExitCodes"]
            if codes.get("containerName", "train") != "train" or exit_code == 0:
                continue
            listed = exit_code in codes["values"]
            if listed == (codes["operator"] == "In"):
                return rule["action"]
        elif any(p["type"] in conditions for p in rule["onPodConditions"]):
            return rule["action"]
    return "Count"


@pytest.fixture(scope="module")
def job():
    with open(os.path.join(REPO, "launch", "kubernetes.yaml")) as f:
        return [d for d in yaml.safe_load_all(f) if d["kind"] == "Job"][0]


def test_kubernetes_fails_the_job_on_a_mistake_and_replaces_other_failures(job):
    spec = job["spec"]
    for code in (2, 130):  # a mistake, an interruption: never again
        assert job_controller_action(spec, code) == "FailJob", code
    for code in (75, 3, 1, 137):  # retryable (a lost peer), a hang, a crash, a kill: counted
        assert job_controller_action(spec, code) == "Count", code
    for code in (137, 143, 2):  # the cluster took the pod away (preemption, drain, eviction)
        assert job_controller_action(spec, code, ["DisruptionTarget"]) == "Ignore", code
    # A pod that saved on SIGTERM must not exit 0: that would complete the Job.
    (container,) = spec["template"]["spec"]["containers"]
    (flag,) = [a for a in container["args"] if a.startswith("--preempted_exit_code=")]
    preempted = int(flag.split("=")[1])
    assert preempted != 0
    assert job_controller_action(spec, preempted, ["DisruptionTarget"]) == "Ignore"
    # Every index fails once per restart (the survivors exit 75): a per-index limit counts
    # restarts, and the first index out of them fails the Job rather than leave its peers waiting.
    assert spec["completionMode"] == "Indexed" and spec["backoffLimitPerIndex"] > 0
    assert spec["maxFailedIndexes"] == 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy and per-index limits need it
    assert spec["podReplacementPolicy"] == "Failed"  # one pod per rank at a time
    assert pod["terminationGracePeriodSeconds"] >= 60  # time to save after SIGTERM


def test_kubernetes_replacement_pods_run_the_same_command_on_the_same_workdir(job):
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "train"  # the name the exit-code rule looks at
    workdir = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--workdir="))
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    mounts = [m for m in container["volumeMounts"] if workdir.startswith(m["mountPath"] + "/")]
    assert len(mounts) == 1 and mounts[0]["name"] in claims, (workdir, mounts, claims)
