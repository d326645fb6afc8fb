"""`python -m experiments.report` draws its pictures from the planner, benchmark JSON and
workdirs' metrics, and refuses a workdir without metrics in one line."""

import json

import pytest

from experiments import report
from tests.helpers import REPO


def test_report_draws_every_picture(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [{"layout": "ddp", "measured_ms": 10.0, "predicted_ms": 11.0}]
    (bench / "planner.json").write_text(json.dumps({"rows": rows}))
    workdir = tmp_path / "run"
    workdir.mkdir()
    records = [{"step": s, "loss": 2.0 / s} for s in (1, 2, 3)] + [{"step": 3, "eval_loss": 1.0}]
    (workdir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "out"
    written = report.main(
        [
            f"--out={out}",
            f"--config={REPO}/experiments/configs/gpt_124m.py",
            "--max_devices=16",
            "--no_published",
            f"--bench={bench}",
            f"--workdirs={workdir}",
        ]
    )
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == ["bench.png", "curves.png", "memory.png", "scaling.png"]
    for path in written:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_workdir_without_metrics_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report.main([f"--out={tmp_path}", f"--workdirs={tmp_path}"])
    assert exit_info.value.code == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
