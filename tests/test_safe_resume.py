"""Never lose what the user had: a rerun with another config is refused naming the keys before
anything is written (or, allowed, continues and is recorded); a finished run run again changes
nothing; a restore that fails for another reason than damage moves nothing; every checkpoint
damaged stops without a fresh start; a full disk stops the run in one line with the earlier
checkpoints intact; a fallback restore prints no stray tracebacks. Workdirs are compared by
checksumming every file before and after."""

import asyncio
import errno
import gc
import glob
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest

from jddp.errors import CheckpointError, WorkdirError
from jddp.run.cli import program_quiet
from jddp.run.experiment import train_and_evaluate
from tests.helpers import (
    REPO,
    SMALL_FLAGS,
    BeforeRerun,
    assert_one_line,
    checkout_env,
    fail_state_restores,
    run_cli,
    small_config,
    snapshot,
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run trained to its end: checkpoints at steps 5 and 10, export, summary."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    train_and_evaluate(small_config(), str(workdir))
    return workdir


@pytest.fixture
def workdir(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------- 6: config changes
@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"learning_rate": 1e-3}, ["learning_rate: 0.002 -> 0.001"]),
        ({"seed": 1, "global_batch_size": 64}, ["global_batch_size: 128 -> 64", "seed: 0 -> 1"]),
        ({"num_train_steps": 20}, ["num_train_steps: 10 -> 20"]),
    ],
)
def test_a_changed_config_is_refused_naming_the_keys_and_nothing_is_written(
    workdir, overrides, words
):
    before = snapshot(workdir)
    with pytest.raises(WorkdirError) as error:
        train_and_evaluate(small_config(**overrides), str(workdir))
    assert_one_line(error, "another config", *words, "config.json", "allow_config_change=true")
    assert snapshot(workdir) == before


def test_a_finished_run_run_again_changes_nothing(workdir):
    """Also with keys that only change how the run is logged and checkpointed."""
    before = snapshot(workdir)
    saved = json.loads((workdir / "summary.json").read_text())
    for overrides in ({}, {"log_every": 1, "eval_every": 2, "checkpoint_every": 3}):
        summary = train_and_evaluate(small_config(**overrides), str(workdir))
        assert summary["eval_accuracy"] == saved["eval_accuracy"]
        assert snapshot(workdir) == before


def test_an_allowed_change_continues_and_is_recorded_in_the_metrics(workdir):
    first, before = records(workdir), BeforeRerun(workdir)
    assert before.resume_step == 10  # the finished run's last checkpoint
    config = small_config(num_train_steps=15, learning_rate=1e-3, allow_config_change=True)
    train_and_evaluate(config, str(workdir))
    before.assert_resumed(log_every=5)
    after = records(workdir)
    assert after[: len(first)] == first and [r["step"] for r in after[len(first) :]] == [15]
    changes = {"learning_rate": [0.002, 0.001], "num_train_steps": [10, 15]}
    assert after[-1]["config_changes"] == changes
    # Step 15 applied update 14 of the new schedule: cosine from 1e-3 over 15 updates.
    expected_rate = 1e-3 * 0.5 * (1 + math.cos(math.pi * 14 / 15))
    assert after[-1]["learning_rate"] == pytest.approx(expected_rate, rel=1e-5)
    assert json.loads((workdir / "config.json").read_text())["num_train_steps"] == 15


# ------------------------------------------------------------------- 7: failures to restore
@pytest.mark.parametrize(
    "failure",
    [
        MemoryError("injected"),
        OSError(errno.EIO, "Input/output error"),
        ValueError("RESOURCE_EXHAUSTED: injected: out of memory while allocating 4.0 GiB"),
    ],
    ids=["host-memory", "io-error", "device-memory"],
)
def test_a_restore_failing_for_another_reason_than_damage_moves_nothing(
    workdir, monkeypatch, failure
):
    before = snapshot(workdir)
    fail_state_restores(monkeypatch, failure)
    with pytest.raises(CheckpointError) as error:
        train_and_evaluate(small_config(), str(workdir))
    assert_one_line(error, "checkpoints/10", type(failure).__name__, "not damage", "nothing was")
    assert snapshot(workdir) == before


def test_every_checkpoint_damaged_stops_without_a_fresh_start(workdir):
    for path in glob.glob(str(workdir / "checkpoints/*/state/**/d/*"), recursive=True):
        os.truncate(path, os.path.getsize(path) // 2)
    logs = {k: v for k, v in snapshot(workdir).items() if not k.startswith("checkpoints")}
    with pytest.raises(CheckpointError) as error:
        train_and_evaluate(small_config(num_train_steps=20, allow_config_change=True), workdir)
    assert_one_line(error, "every checkpoint", "damaged", "checkpoints_damaged", "new --workdir")
    moved = sorted(p.split("-")[0] for p in os.listdir(workdir / "checkpoints_damaged"))
    assert moved == ["10", "5"] and os.listdir(workdir / "checkpoints") == []
    with pytest.raises(WorkdirError) as error:  # and running it again does not start afresh
        train_and_evaluate(small_config(num_train_steps=20, allow_config_change=True), workdir)
    assert_one_line(error, "all damaged", "new --workdir")
    after = snapshot(workdir)
    assert {k: after[k] for k in logs} == logs


# ----------------------------------------------------- 9: a fallback restore, as the user sees it
def test_a_fallback_restore_prints_no_stray_tracebacks(workdir):
    """Truncated array files, as in the report: the arrays' metadata reads and the first chunks
    succeed, so reads are still in flight when one fails (with the files removed the read fails
    at the metadata, before any array read starts, and nothing is abandoned: this test once
    passed while a truncated checkpoint printed orbax's abandoned reads, ~60 lines each)."""
    for path in glob.glob(str(workdir / "checkpoints/10/state/ocdbt.process_*/d/*")):
        os.truncate(path, os.path.getsize(path) // 2)
    os.remove(workdir / "summary.json")
    result = run_cli(f"--workdir={workdir}", *SMALL_FLAGS)
    assert result.returncode == 0, result.stderr
    assert "checkpoints/10 is damaged" in result.stderr
    for stray in ("Traceback", "Exception ignored", "Event loop is closed", "was never awaited"):
        assert stray not in result.stderr, result.stderr
    assert records(workdir)[-1]["step"] == 10


def abandon_a_failed_task(message: str) -> None:
    """A task that fails with `message` and that nobody awaits, as orbax leaves its other reads
    when one fails: asyncio reports it ("Task exception was never retrieved") once collected."""

    async def fail():
        raise ValueError(message)

    loop = asyncio.new_event_loop()
    task = loop.create_task(fail())
    loop.run_until_complete(asyncio.wait([task]))
    loop.close()
    del task
    gc.collect()


def test_asyncio_reports_of_a_damaged_checkpoints_reads_are_dropped(workdir, caplog):
    """Whether asyncio reports orbax's unawaited reads of the damaged checkpoint depends on when
    the garbage collector runs (once, in CI, the test above printed one); here such a report is
    made on purpose, after the fallback restore, and one about another directory for contrast.
    In the CLI's process, which holds `program_quiet` to its end (the library holds it only
    while a checkpoint manager is open: tests/test_process_state.py)."""
    for path in glob.glob(str(workdir / "checkpoints/10/state/**/d/*"), recursive=True):
        os.remove(path)
    with program_quiet().held():
        train_and_evaluate(small_config(num_train_steps=15, allow_config_change=True), workdir)
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            abandon_a_failed_task(f"NOT_FOUND: reading {workdir}/checkpoints/10/state/d/0")
            assert not [r for r in caplog.records if r.name == "asyncio"]
            abandon_a_failed_task(f"NOT_FOUND: reading {workdir}/elsewhere/d/0")
            (report,) = [r for r in caplog.records if r.name == "asyncio"]
    assert "never retrieved" in report.getMessage() and "elsewhere" in str(report.exc_info[1])


# ------------------------------------------------------------------------------ 8: full disk
def train_with_files_limited(workdir) -> subprocess.CompletedProcess:
    """The CLI trained on in `workdir` to step 40 where no file may grow past 128 KiB."""
    limited = (
        "import resource, runpy, sys; "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2**17, 2**17)); "
        "sys.argv[0] = 'train'; runpy.run_module('experiments.train', run_name='__main__')"
    )
    flags = [f"--workdir={workdir}", *SMALL_FLAGS, "--config.num_train_steps=40"]
    return subprocess.run(
        [sys.executable, "-c", limited, *flags, "--config.allow_config_change=true"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=checkout_env(),
    )


def test_a_write_error_during_a_save_stops_there_in_one_line(workdir):
    """Files may not grow past 128 KiB (RLIMIT_FSIZE, no privileges needed): the 1 MiB
    checkpoint of step 15 fails to write, in orbax's background thread, like a full disk. (Orbax
    splits a checkpoint into data files differently from save to save, but no file can be smaller
    than the state's largest array, 256 KiB; at 512 KiB a split into small files once saved.)"""
    kept = {k: v for k, v in snapshot(workdir).items() if k.startswith("checkpoints/")}
    result = train_with_files_limited(workdir)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    for words in ("error: could not save the checkpoint of step 15", str(workdir / "checkpoints")):
        assert words in last, last
    assert "File too large (it needs about 996.1 KiB" in last and "(newest: step 10)" in last
    after = snapshot(workdir)
    assert {k: after[k] for k in kept} == kept  # 5 and 10, though max_to_keep is 2
    assert sorted(n for n in os.listdir(workdir / "checkpoints") if n.isdigit()) == ["10", "5"]
    assert records(workdir)[-1]["step"] <= 20  # stopped, not trained on to 40


# Run in a mount namespace of its own (a user namespace too without root), where the tmpfs
# below can be mounted without privileges and vanishes with the run: DISK (4 MiB) gets a copy
# of the run and a ballast file leaving 64 KiB (metrics fit, a checkpoint not), the CLI trains
# on there, and what it left in checkpoints/ is copied out to OUT.
FULL_DISK_RUN = """
set -e
mount -t tmpfs -o size=4m tmpfs "$DISK"
cp -a "$WORKDIR" "$DISK/run"
"$PYTHON" -c 'import shutil, sys; open(sys.argv[1] + "/ballast", "wb").write(
    bytes(shutil.disk_usage(sys.argv[1]).free - 64 * 1024))' "$DISK"
set +e
"$PYTHON" -m experiments.train --workdir="$DISK/run" "$@"
code=$?
cp -a "$DISK/run/checkpoints" "$OUT/checkpoints"
exit $code
"""


def test_a_full_disk_during_a_save_stops_there_in_one_line(workdir, tmp_path):
    """A real full disk: a 4 MiB tmpfs holding the run and a ballast file. Where no mount
    namespace can be made (a container without the privilege), files limited to 128 KiB stand
    in: the same failed write of the save, which the OS calls "File too large"."""
    kept = {k: v for k, v in snapshot(workdir).items() if k.startswith("checkpoints/")}
    namespace = ["unshare", "--mount"]
    if os.geteuid() != 0:
        namespace[1:1] = ["--user", "--map-root-user"]
    probe = [*namespace, "mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(tmp_path)]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode:
        result, reason = train_with_files_limited(workdir), "File too large"
        left = workdir
    else:
        result, reason = train_on_a_full_tmpfs(workdir, tmp_path, namespace), "No space left"
        left = tmp_path / "out"
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    for words in ("error: could not save the checkpoint of step 15", reason, "(newest: step 10)"):
        assert words in last, last
    after = snapshot(left)
    assert {k: after.get(k) for k in kept} == kept


def train_on_a_full_tmpfs(workdir, tmp_path, namespace) -> subprocess.CompletedProcess:
    """The CLI trained on to step 40 in a copy of `workdir` on a 4 MiB tmpfs with 64 KiB free,
    mounted in `namespace`; what it left in checkpoints/ is copied to tmp_path/out."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "out").mkdir()
    flags = [*SMALL_FLAGS, "--config.num_train_steps=40", "--config.allow_config_change=true"]
    return subprocess.run(
        [*namespace, "bash", "-c", FULL_DISK_RUN, "full_disk_run", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=checkout_env(
            DISK=str(tmp_path / "disk"),
            WORKDIR=str(workdir),
            OUT=str(tmp_path / "out"),
            PYTHON=sys.executable,
        ),
    )
