"""A benchmark refuses an --out it could not write into before it measures anything, and a
write that fails at the end is one line: experiments/bench/common.py."""

import subprocess
import sys

import pytest

from experiments.bench import common
from tests.helpers import REPO, checkout_env


def refusal(capsys, call) -> str:
    """The one line `call` ends with (exit code 2)."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_an_out_folder_that_cannot_be_written_is_refused(tmp_path, capsys):
    a_file = tmp_path / "results"
    a_file.write_text("kept")
    line = refusal(capsys, lambda: common.check_output_folder(str(a_file)))
    assert line.startswith(f"error: --out '{a_file}' is a file;")
    line = refusal(capsys, lambda: common.check_output_folder(str(a_file / "run")))
    assert "which is a file" in line
    assert a_file.read_text() == "kept"

    fresh = tmp_path / "new" / "run"
    common.check_output_folder(str(fresh))  # a folder still to be made is fine, and not made
    assert not fresh.parent.exists()


def test_a_count_below_one_is_refused(capsys):
    line = refusal(capsys, lambda: common.check_counts(repeats=11, instances=0))
    assert line == "error: --instances 0: give a whole number of 1 or more"
    common.check_counts(repeats=1, instances=3)  # counts of 1 or more pass


def test_a_failed_write_of_the_results_is_one_line(tmp_path, capsys):
    a_file = tmp_path / "results"
    a_file.write_text("kept")
    rows = [{"variant": "a", "ms": 1.0}]
    line = refusal(capsys, lambda: common.report("bench", rows, {}, str(a_file)))
    assert line.startswith(f"error: cannot write {a_file}/bench.json: ")
    assert a_file.read_text() == "kept"


def test_a_benchmark_checks_out_before_measuring(tmp_path):
    """The planner benchmark's --bytes compiles every layout for minutes; a bad --out ends it
    before the first compile."""
    a_file = tmp_path / "results"
    a_file.write_text("kept")
    run = subprocess.run(
        [sys.executable, "-m", "experiments.bench.planner", "--bytes", f"--out={a_file}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=checkout_env(),
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: --out '{a_file}' is a file; pass a folder you can write to"
    ]
    assert a_file.read_text() == "kept"
