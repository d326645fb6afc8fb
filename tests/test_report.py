"""`python -m experiments.report` draws its pictures from the planner, benchmark JSON and
workdirs' metrics, and refuses a workdir without metrics in one line."""

import json

import pytest

from experiments import report
from tests.helpers import REPO, assert_error_output


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


@pytest.mark.parametrize(
    "mistake, message",
    [
        ("out_is_a_file", "is a file; pass a folder you can write to"),
        ("missing_config", "is not a file; pass an experiment config"),
        ("config_without_get_config", "defines no get_config()"),
        ("unknown_device", "unknown --device='h1000'"),
        ("bench_not_json", "planner.json is not JSON"),
        ("metrics_not_json", "metrics.jsonl is not JSON"),
    ],
)
def test_a_mistake_is_one_line_and_writes_nothing(tmp_path, capsys, mistake, message):
    bench, workdir, out = tmp_path / "bench", tmp_path / "run", tmp_path / "out"
    bench.mkdir()
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}))
    args = {
        "--out": str(out),
        "--config": f"{REPO}/experiments/configs/gpt_124m.py",
        "--max_devices": "8",
        "--bench": str(bench),
        "--workdirs": str(workdir),
    }
    if mistake == "out_is_a_file":
        out.write_text("kept")
    elif mistake == "missing_config":
        args["--config"] = str(tmp_path / "gpt.py")
    elif mistake == "config_without_get_config":
        args["--config"] = str(tmp_path / "gpt.py")
        (tmp_path / "gpt.py").write_text("MODEL = 'gpt'\n")
    elif mistake == "unknown_device":
        args["--device"] = "h1000"
    elif mistake == "bench_not_json":
        (bench / "planner.json").write_text("{")
    else:
        (workdir / "metrics.jsonl").write_text("loss 1.0\n")
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--no_published", *(f"{k}={v}" for k, v in args.items())])
    assert exit_info.value.code == 2
    assert_error_output(capsys.readouterr().err, message)
    assert out.read_text() == "kept" if mistake == "out_is_a_file" else not out.exists()
