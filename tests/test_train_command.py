"""The installed `jddp-train` command, and `jddp-launch` starting its children in its own
environment: `--help` names `--config` and where the keys are documented; `jddp-launch --
jddp-train ...` (the user's model on the user's JSON Lines rows, from a directory outside the
checkout) and `jddp-launch -- python -m experiments.train ...` (on the config's npz rows) train
on 2 processes what one device trains, even when the first `python` and `jddp-train` on PATH are
other programs (the bug: every rank started the system `python`, which had no absl)."""

import argparse
import os
import subprocess
import sys

import pytest

from jddp.runtime import launch
from tests.helpers import REPO, assert_error_exit
from tests.test_multiprocess import launch as launch_job
from tests.test_own_models import (
    JDDP_TRAIN,
    WIDTH,
    assert_matches_reference,
    data_flags,
    linen_reference,
    train_cli,
    write_user_package,
)

JDDP_LAUNCH = os.path.join(os.path.dirname(sys.executable), "jddp-launch")
HARD_TIMEOUT_SEC = 240


@pytest.fixture(scope="module")
def own_config(tmp_path_factory):
    return write_user_package(tmp_path_factory.mktemp("user"))


@pytest.fixture(scope="module")
def expected(own_config):
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(os.path.dirname(own_config))
        return linen_reference()


@pytest.fixture(scope="module")
def impostors(tmp_path_factory) -> str:
    """A folder of a `python` and a `jddp-train` that are not this environment's: each says so
    and exits 3. First on PATH, it stands for a system Python without jddp."""
    folder = tmp_path_factory.mktemp("impostors")
    for name in ("python", "python3", "jddp-train"):
        path = folder / name
        path.write_text(f'#!/bin/sh\necho "error: the wrong {name} ran" >&2\nexit 3\n')
        path.chmod(0o755)
    return str(folder)


def test_help_names_config_and_where_its_keys_are_documented(tmp_path):
    result = subprocess.run(
        [JDDP_TRAIN, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stderr  # absl's --help exit status
    for words in ("--config:", "docs/configs.md", "--workdir:", "--num_processes:", "jddp-train"):
        assert words in result.stdout, (words, result.stdout)
    assert os.listdir(tmp_path) == []


def test_a_missing_config_file_is_one_line(tmp_path):
    result = train_cli(tmp_path / "nowhere.py", tmp_path, "--workdir=run")
    assert_error_exit(result, "nowhere.py", "not found", "--config=PATH")
    assert os.listdir(tmp_path) == []


def test_launch_runs_python_and_console_scripts_from_its_own_environment(impostors):
    own_bin = os.path.dirname(sys.executable)
    for python in ("python", "python3", f"python3.{sys.version_info.minor}"):
        assert launch.child_command([python, "-m", "x"]) == [sys.executable, "-m", "x"]
    jddp_train = os.path.join(own_bin, "jddp-train")
    assert launch.child_command(["jddp-train", "--a"]) == [jddp_train, "--a"]
    as_written = (["python3.1", "x"], [os.path.join(impostors, "python")], ["no-such-program"])
    for command in as_written:  # another version, a path, a program not beside this Python
        assert launch.child_command(command) == command
    args = argparse.Namespace(nproc=2, devices_per_proc=0, gpus_per_proc=0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{impostors}{os.pathsep}/usr/bin")
        path = launch.child_env(1, args, 1234)["PATH"].split(os.pathsep)
    assert path == [own_bin, impostors, "/usr/bin"]


def run_launched(command, cwd, impostors):
    """`jddp-launch --nproc 2 --devices_per_proc 1 -- COMMAND` in `cwd`, the impostors first on
    PATH; SIGKILLed with its children past the hard timeout."""
    env = {"PATH": f"{impostors}{os.pathsep}{os.environ.get('PATH', '')}"}
    return launch_job(
        2, 1, *command, env=env, cwd=cwd, program=JDDP_LAUNCH, timeout=HARD_TIMEOUT_SEC
    )


@pytest.mark.parametrize("program", ["jddp-train", "python -m experiments.train"])
def test_two_launched_processes_train_what_one_device_trains(
    program, own_config, expected, impostors, tmp_path
):
    """`jddp-train` from a directory outside the checkout, on JSON Lines; `python -m
    experiments.train` from the checkout, as the README and docs/multi-host.md write it. Each
    process reads only its rows of every batch: the losses and the eval over every row once
    equal one device's."""
    workdir = tmp_path / "run"
    cwd = tmp_path if program == "jddp-train" else REPO
    flags = [f"--config={own_config}", f"--workdir={workdir}", f"--config.model_args.width={WIDTH}"]
    if program == "jddp-train":
        flags += data_flags(own_config, "jsonl")
    code, output = run_launched([*program.split(), *flags], cwd, impostors)
    assert code == 0, output[-3000:]
    assert "the wrong" not in output
    assert output.count("done: eval accuracy") == 1  # process 0 speaks for the job
    assert_matches_reference(workdir, expected)
