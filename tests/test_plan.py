"""The planner's memory (exact state bytes; compiled peaks where it compiles) and its command
line: the `--json` contract, `--published`, and bad input in one line with exit code 2."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments.configs import digits_mlp
from jddp import data, optim
from jddp.experiment import build_trainer
from jddp.planner.compiled import compiled_peaks
from jddp.planner.layouts import Layout
from jddp.planner.memory import state_bytes
from jddp.planner.search import layouts_for
from jddp.planner.workload import from_config
from tests.helpers import REPO

# digits_mlp: 64-256-256-10. Kernels of at least 4096 elements (64x256, 256x256) shard over the
# devices; the 256x10 kernel and the biases stay replicated.
SHARDED = 64 * 256 + 256 * 256
REPLICATED = 256 * 10 + 256 + 256 + 10
PARAMS = SHARDED + REPLICATED


def test_state_bytes_are_exact_for_every_strategy_and_mesh():
    workload = from_config(digits_mlp.get_config())
    layouts, rejected = layouts_for(workload, 8, 8, stages=False)
    # The MLP has no tensor rules: meshes with a tensor axis are left out; fsdp 8, 4 and 2.
    assert [layout.name for layout in layouts] == ["ddp batch:8"] + [
        f"{stage} {mesh}"
        for mesh in ("fsdp:8", "data:2,fsdp:4", "data:4,fsdp:2")
        for stage in ("zero1", "zero2", "zero3")
    ]
    assert all("transformers only" in why for name, why in rejected.items() if "tensor" in name)
    full = 4 * PARAMS
    for layout in layouts:
        sharded = 4 * (SHARDED // layout.fsdp + REPLICATED)
        params, grads, optimizer = {  # Adam keeps two moments per parameter
            "ddp": (full, full, 2 * full),
            "zero1": (full, full, 2 * sharded),
            "zero2": (full, sharded, 2 * sharded),
            "zero3": (sharded, sharded, 2 * sharded),
        }[layout.strategy]
        state = state_bytes(workload, layout)
        assert (state.params, state.grads) == (params, grads), layout.name
        assert state.optimizer == pytest.approx(optimizer, abs=64), layout.name  # + Adam's count


def test_compiled_peak_is_the_peak_of_the_real_step():
    config = digits_mlp.get_config()
    layouts = [Layout("ddp", data=8), Layout("zero3", fsdp=8)]
    peaks = compiled_peaks(config, layouts)
    dataset = data.get_dataset(config.dataset)
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.random((config.global_batch_size, 8, 8, 1), np.float32),
        "label": rng.integers(0, 10, config.global_batch_size).astype(np.int32),
    }
    for layout in layouts:
        mesh = None if layout.strategy == "ddp" else layout.mesh_spec
        trainer = build_trainer(
            config, dataset, optim.learning_rate_schedule(config), strategy=layout.strategy,
            mesh=mesh,
        )  # fmt: skip
        state = trainer.init(seed=0, sample_batch=batch)
        assert trainer.memory_report(state, batch)["peak_bytes_per_device"] == peaks[layout.name]
    assert peaks["ddp batch:8"] > peaks["zero3 fsdp:8"]
    assert jax.device_count() == 8


# ---------------------------------------------------------------------------- the CLI
def run_plan(*args):
    return subprocess.run(
        [sys.executable, "-m", "jddp.plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


GPT_124M = "--config=experiments/configs/gpt_124m.py"
ROW_KEYS = {"strategy": str, "mesh": dict, "bytes_per_device": int, "fits": bool}
ROW_KEYS |= {"predicted_step_s": float, "predicted_mfu": float}


def test_json_rows_follow_the_contract_best_first():
    result = run_plan(GPT_124M, "--devices=64", "--device=a100-80gb", "--json", "--top=5")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert len(rows) == 5
    for row in rows:
        for key, kind in ROW_KEYS.items():
            assert isinstance(row[key], kind), (key, row[key])
        assert set(row["mesh"]) == {"data", "fsdp", "tensor", "stage"}
        assert np.prod(list(row["mesh"].values())) == 64
        assert 0 < row["predicted_mfu"] < 1 and row["fits"]
    steps = [row["predicted_step_s"] for row in rows]
    assert steps == sorted(steps)


def test_published_json_points():
    result = run_plan("--published", "--json")
    assert result.returncode == 0, result.stderr
    points = json.loads(result.stdout)["points"]
    names = {p["name"] for p in points}
    assert {"PaLM 540B", "Megatron-LM GPT 1T", "MaxText 22B on 8x v4-128"} <= names
    for p in points:
        assert {"name", "source", "published_mfu", "predicted_mfu"} <= set(p)
        assert p["source"] and 0 < p["predicted_mfu"] < 1 and p["best"]["layout"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--device=v100"], "unknown --device='v100'; choose one of"),
        ([GPT_124M, "--devices=7", "--devices_per_host=7"], "7 devices do not factor for gpt"),
        (["--device=h100", "--bw_intra=0"], "bw_intra=0.0 must be positive"),
        (["--devices_per_host=3"], "must divide --devices=8"),
        (["--device_memory=lots"], "is not an amount"),
        (
            [GPT_124M, "--devices=8", "--device_memory=2GB", "--compile=no"],
            "fits nowhere: the closest plan is ",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message):
    result = run_plan(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    if "fits nowhere" in message:
        assert " over the 1.9 GiB of a device" in lines[0]
