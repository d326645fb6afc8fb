"""The memory planner: exact per-device bytes per strategy, and a one-line refusal when nothing
fits."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments.configs import digits_mlp
from jddp import data, optim
from jddp.experiment import build_trainer
from jddp.plan import plan
from tests.helpers import REPO

# digits_mlp: 64-256-256-10. Kernels of at least 4096 elements (64x256, 256x256) shard over the
# devices; the 256x10 kernel and the biases stay replicated.
SHARDED = 64 * 256 + 256 * 256
REPLICATED = 256 * 10 + 256 + 256 + 10
PARAMS = SHARDED + REPLICATED


def test_plan_gives_exact_per_device_bytes_for_every_strategy_and_mesh():
    rows = {(row["strategy"], row["mesh"]): row for row in plan(digits_mlp.get_config(), 8, 0)}
    # The MLP has no tensor rules: meshes with a tensor axis are left out; fsdp 8, 4 and 2.
    meshes = ["fsdp:8", "data:2,fsdp:4", "data:4,fsdp:2"]
    assert list(rows) == [("ddp", "batch:8")] + [
        (stage, mesh) for mesh in meshes for stage in ("zero1", "zero2", "zero3")
    ]
    full = 4 * PARAMS

    def sharded(fsdp):  # the 64x256 and 256x256 kernels split over fsdp
        return 4 * (SHARDED // fsdp + REPLICATED)

    for (name, mesh), row in rows.items():
        fsdp = {"fsdp:8": 8, "data:2,fsdp:4": 4, "data:4,fsdp:2": 2}.get(mesh, 1)
        params, grads, optimizer = {  # Adam keeps two moments per parameter
            "ddp": (full, full, 2 * full),
            "zero1": (full, full, 2 * sharded(fsdp)),
            "zero2": (full, sharded(fsdp), 2 * sharded(fsdp)),
            "zero3": (sharded(fsdp), sharded(fsdp), 2 * sharded(fsdp)),
        }[name]
        assert (row["params"], row["grads"]) == (params, grads), (name, mesh)
        assert row["optimizer"] == pytest.approx(optimizer, abs=64), name  # + Adam's step count
    peaks = [
        rows[key]["peak"]
        for key in [("ddp", "batch:8")] + [(s, "fsdp:8") for s in ("zero1", "zero2", "zero3")]
    ]
    assert peaks == sorted(peaks, reverse=True)  # each stage holds less than the one before


MESHES_OF = ("batch:8", "fsdp:8")  # ddp's and zero3's default meshes


def test_planned_peak_is_the_peak_of_the_real_step():
    config = digits_mlp.get_config()
    rows = {row["strategy"]: row for row in plan(config, 8, 0) if row["mesh"] in MESHES_OF}
    dataset = data.get_dataset(config.dataset)
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.random((config.global_batch_size, 8, 8, 1), np.float32),
        "label": rng.integers(0, 10, config.global_batch_size).astype(np.int32),
    }
    for name in ("ddp", "zero3"):
        trainer = build_trainer(
            config, dataset, optim.learning_rate_schedule(config), strategy=name
        )
        state = trainer.init(seed=0, sample_batch=batch)
        assert trainer.memory_report(state, batch)["peak_bytes_per_device"] == rows[name]["peak"]
    assert jax.device_count() == 8


def run_plan(*args):
    return subprocess.run(
        [sys.executable, "-m", "jddp.plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_lists_strategies_that_fit():
    result = run_plan("--devices=4", "--device_memory=80GB")
    assert result.returncode == 0, result.stderr
    for name in ("ddp", "zero1", "zero2", "zero3", "data:2,fsdp:2"):
        assert name in result.stdout
    assert "fits: ddp batch:4; zero1 fsdp:4; zero2 fsdp:4; zero3 fsdp:4" in result.stdout


def test_cli_refuses_a_config_that_fits_nowhere_in_one_line():
    result = run_plan("--devices=8", "--device_memory=100KB")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: fits nowhere"), result.stderr
    assert "zero3" in lines[0] and "over the 97.7 KiB of a device" in lines[0]


@pytest.mark.parametrize(
    "args,message",
    [(["--device_memory=lots"], "is not a size"), (["--devices_per_host=3"], "must divide")],
)
def test_cli_bad_flags_are_one_line(args, message):
    result = run_plan("--devices=8", *args)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
