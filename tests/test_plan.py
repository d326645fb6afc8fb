"""The planner's memory (exact state bytes; compiled peaks where it compiles) and its command
line: the `--json` contract, `--published`, and bad input in one line with exit code 2."""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments.configs import digits_mlp
from jddp import data
from jddp.errors import ConfigError
from jddp.planner import devices, published, search
from jddp.planner.compiled import compiled_peaks
from jddp.planner.layouts import Layout
from jddp.planner.memory_model import state_bytes
from jddp.planner.search import layouts_for
from jddp.planner.workload import from_config
from jddp.run import optim
from jddp.run.factory import build_trainer
from tests.commands_in_one_process import run_commands
from tests.helpers import REPO, assert_error_exit

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
        for stage in ("zero1", "zero2", "zero3", "auto")
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
            "auto": (sharded, sharded, 2 * sharded),  # zero3's layout
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
def test_the_cli_compiles_every_plan_on_up_to_8_devices():
    """On 2 devices the CLI replaces each row's analytic memory with its compiled step's peak
    (once lost when a row without a context axis carried no attention choice)."""
    command = [sys.executable, "-m", "jddp.plan", "--config=experiments/configs/digits_mlp.py"]
    result = subprocess.run(
        [*command, "--devices=2", "--json"], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert rows and all(row["memory_source"] == "compiled" for row in rows), rows


GPT_124M = "experiments/configs/gpt_124m.py"
ROW_KEYS = {"strategy": str, "mesh": dict, "bytes_per_device": int, "fits": bool}
ROW_KEYS |= {"predicted_step_s": float, "predicted_mfu": float}


def gpt_124m():
    from experiments.configs import gpt_124m

    return from_config(gpt_124m.get_config())


def test_json_rows_follow_the_contract_best_first():
    """The rows `--json` prints (search.plan's, as JSON) for GPT-124M on 64 A100s."""
    rows, _ = search.plan(gpt_124m(), 64, devices.PRESETS["a100-80gb"], 8)
    rows = json.loads(json.dumps({"rows": rows[:5]}))["rows"]
    assert len(rows) == 5
    for row in rows:
        for key, kind in ROW_KEYS.items():
            assert isinstance(row[key], kind), (key, row[key])
        assert set(row["mesh"]) == {"data", "fsdp", "tensor", "stage"}
        assert np.prod(list(row["mesh"].values())) == 64
        assert 0 < row["predicted_mfu"] < 1 and row["fits"]
    steps = [row["predicted_step_s"] for row in rows]
    assert steps == sorted(steps)


def test_published_json_point():
    """A `--published --json` point: its source, both utilizations, the best mesh."""
    run = next(r for r in published.RUNS if r.name == "MaxText 22B on 8x v4-128")
    p = json.loads(json.dumps(published.point(run)))
    assert {"name", "source", "published_mfu", "predicted_mfu"} <= set(p)
    assert "MaxText" in p["source"] and 0 < p["predicted_mfu"] < 1 and p["best"]["layout"]
    assert abs(p["predicted_mfu"] / p["published_mfu"] - 1) < 0.15


def test_bad_input_is_one_line_naming_the_problem():
    """Unknown device, zero bandwidth, devices that do not factor: the library's one-line
    errors, which the CLI prints as `error: ...` with exit code 2 (the next test)."""
    with pytest.raises(ConfigError, match="unknown --device='v100'; choose one of a100-80gb, h100"):
        devices.get_profile("v100")
    zero = dataclasses.replace(devices.PRESETS["h100"], bw_intra=0.0)
    with pytest.raises(ConfigError, match="bw_intra=0.0 must be positive; pass --bw_intra="):
        zero.check()
    with pytest.raises(ConfigError, match="7 devices do not factor for gpt"):
        search.plan(gpt_124m(), 7, devices.PRESETS["h100"], 7)


def run_plan(*flags: str) -> subprocess.CompletedProcess:
    """`python -m jddp.plan` on GPT-124M without compiling, in a subprocess."""
    command = [sys.executable, "-m", *PLAN_124M, *flags]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_nothing_fits_exits_2_with_the_closest_plan_in_one_line():
    """The command line end to end (a subprocess): GPT-124M on 8 devices of 2 GB."""
    result = run_plan("--devices=8", "--device_memory=2GB", "--device=h100")
    line = assert_error_exit(result, " over the 1.9 GiB of a device")
    assert line.startswith("error: fits nowhere: the closest plan is "), line


PLAN_124M = ["jddp.plan", f"--config={GPT_124M}", "--compile=no"]
FORM_MISTAKES = [
    ("--peak_flops", "1.2.3", "is not an amount"),
    ("--latency_inter", "-1us", "is not a duration"),
    ("--devices_per_host", "-8", "must be at least 1, or 0 for the device's usual host"),
]


@pytest.fixture(scope="module")
def flag_commands():
    """The flag tests' plans, in one process (the test beside them starts its own): every
    number in the help's forms, each mistake of FORM_MISTAKES, and `--top=-3`."""
    plan = [*PLAN_124M, "--devices=8"]
    return run_commands(
        [
            plan + [
                "--device=h100", "--peak_flops=989e12", "--bw_inter=0.05E3GB",
                "--latency_intra=3E-6", "--device_memory=80GiB", "--json", "--top=1",
                "--step_spread=0.1", "--devices_per_host=4",
            ],
            *(plan + [f"{flag}={value}"] for flag, value, _ in FORM_MISTAKES),
            [*PLAN_124M, "--top=-3"],
        ]
    )  # fmt: skip


def test_numbers_in_the_forms_the_help_shows(flag_commands):
    """`--peak_flops=989e12` (the flag's own example) was refused as "not an amount; write e.g.
    ... 450e9": the parser upper-cased the text and then looked for a lower-case exponent."""
    result, *refused = flag_commands[: 1 + len(FORM_MISTAKES)]
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert len(rows) == 1
    assert rows[0]["sync_s"] > 0  # 2 hosts of 4, waiting for the slower
    for (flag, _, words), result in zip(FORM_MISTAKES, refused, strict=True):
        line = assert_error_exit(result, words)
        assert line.startswith(f"error: {flag}="), line


def test_a_negative_top_is_refused_in_one_line(flag_commands):
    """`--top=-3` once showed every plan but the last three, silently."""
    result = flag_commands[-1]
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip()
        == "error: --top=-3 must be a number of plans to show, or 0 for all of them"
    )


def test_the_planner_counts_float16_as_2_bytes_as_the_trainer_computes():
    """The planner's bytes per activation element come from the factory's dtype rule, the one
    the trainer computes in: float16 is 2 bytes (it was once counted as 4)."""
    config = digits_mlp.get_config()
    config.compute_dtype = "float16"
    trainer = build_trainer(config, data.get_dataset(config.dataset))
    assert from_config(config).compute_bytes == 2
    assert np.dtype(trainer.task.compute_dtype).itemsize == 2


# ------------------------------------------------------------------------ own models, rules
OWN_NNX = """
from flax import nnx


class PlannedNnxNet(nnx.Module):
    def __init__(self, num_outputs: int, rngs: nnx.Rngs, width: int = 32):
        self.fc = nnx.Linear(64, width, rngs=rngs)
        self.head = nnx.Linear(width, num_outputs, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.fc(x.reshape(x.shape[0], -1))))
"""


def test_an_own_nnx_model_is_planned_from_its_own_parameters(tmp_path, monkeypatch):
    """`config.model = "pkg.mod:Name"` naming an NNX class ended in "'PlannedNnxNet' object has
    no attribute 'init'" (the planner called Linen's `init`). Its parameters are now the ones
    NNX itself gives the module, and the compiled peak of its real step is found."""
    from flax import nnx

    package = tmp_path / "planned_nets"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(OWN_NNX)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = digits_mlp.get_config()
    config.model, config.model_args = "planned_nets.nets:PlannedNnxNet", {"width": 24}
    config.global_batch_size = 32
    workload = from_config(config)

    from planned_nets.nets import PlannedNnxNet  # the reference: NNX's own parameters

    own = nnx.to_pure_dict(nnx.state(PlannedNnxNet(10, nnx.Rngs(0), width=24), nnx.Param))
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), own)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), workload.params) == shapes
    assert workload.param_count == 64 * 24 + 24 + 24 * 10 + 10
    assert workload.model_flops > 0  # XLA's count of the forward, times 3
    rows, _ = search.plan(workload, 8, devices.PRESETS["h100"], 8, stages=False)
    ddp = next(r for r in rows if r["strategy"] == "ddp")
    assert ddp["state_bytes"]["params"] == 4 * workload.param_count
    peaks = compiled_peaks(config, [Layout("zero3", fsdp=8)])
    assert peaks["zero3 fsdp:8"] > 0


def test_a_rule_of_your_own_that_decides_no_parameter_is_refused_by_the_planner():
    """As training refuses it (jddp/parallel/rules.py): before, the planner planned a typo'd
    rule as if it were not there, and its compiled peaks skipped every sharded layout."""
    config = digits_mlp.get_config()
    config.parallel.rules = (("hiden/kernel", "replicate"),)
    with pytest.raises(ConfigError) as error:
        search.plan(from_config(config), 8, devices.PRESETS["h100"], 8, stages=False)
    message = str(error.value)
    assert "\n" not in message
    assert "partition rule ('hiden/kernel', 'replicate') matches no parameter" in message
    assert "'hidden_1/kernel', 'hidden_0/kernel'" in message
