"""Trackers besides metrics.jsonl (jddp/observe/writers.py): a run stopped mid-way (records
written past its last checkpoint) and resumed by the same `fit` call leaves W&B (offline files)
and MLflow (a local store) holding the scalars metrics.jsonl holds, in one tracker run each, with
the run's config; a tracker whose package is missing is one line naming the extra, before
anything is written."""

import glob
import json
import os
import sys
import threading

import pytest

import jddp
from jddp.errors import ConfigError
from jddp.runtime.workdir import hold_workdir
from tests.helpers import assert_one_line
from tests.test_loop import tiny_batches, tiny_trainer

TRACKERS = ("tensorboard", "wandb", "mlflow")


class Recorder:
    """A Writer of the user's own: keeps what it is given."""

    def __init__(self):
        self.configs, self.entries, self.closed = [], [], 0

    def write_config(self, config):
        self.configs.append(config)

    def write(self, step, scalars):
        self.entries.extend((step, name, value) for name, value in scalars.items())

    def rewind(self, step):
        pass

    def close(self):
        self.closed += 1


class Stop(Exception):
    """Stands for a kill: raised after step 3's record is written, past the checkpoint at 2."""


def stop_at_3(step, state, record):
    if step == 3:
        raise Stop


def wandb_history(workdir) -> tuple[set, list, list[dict]]:
    """(the run ids, the config updates, the history rows in the order logged) of the W&B
    offline runs in workdir/wandb, read from their .wandb files (LevelDB-style log records of
    W&B's protobuf `Record`s) in the order the runs started."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")):
        records = list(_log_records(path, pb.Record))
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        runs.append(((run.start_time.seconds, run.start_time.nanos), run, records))
    ids, configs, rows = set(), [], []
    for _, run, records in sorted(runs, key=lambda r: r[0]):
        ids.add(run.run_id)
        configs.append({item.key: json.loads(item.value_json) for item in run.config.update})
        for record in records:
            if record.WhichOneof("record_type") == "config":
                configs.append({i.key: json.loads(i.value_json) for i in record.config.update})
            if record.WhichOneof("record_type") == "history":
                rows.append({_name(i): json.loads(i.value_json) for i in record.history.item})
    return ids, configs, rows


def _name(item) -> str:
    return item.key or "/".join(item.nested_key)  # W&B splits "train/loss" at the slash


def _log_records(path, record_type):
    """The records of a W&B `.wandb` file: a 7-byte header, then 32 KiB blocks of chunks, each
    a 7-byte header (CRC, little-endian length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    with open(path, "rb") as f:
        data = f.read()
    position, block, pieces = 7, 32768, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        pieces += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = record_type()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def latest_by_step(entries) -> dict[int, dict]:
    """{step: {name: the last value logged for that step}} from (step, name, value) in order."""
    steps = {}
    for step, name, value in entries:
        steps.setdefault(step, {})[name] = value
    return steps


@pytest.fixture
def wandb_service():
    """W&B's service process, and the settings it read, ended after the test (it outlives
    `finish`, for the rest of the process, and keeps the environment it first saw)."""
    import wandb

    yield
    wandb.teardown()


def test_wandb_and_mlflow_hold_metrics_jsonl_scalars_through_a_stop_and_resume(
    tmp_path, monkeypatch, wandb_service
):
    from mlflow import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for variable in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(variable, raising=False)
    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.7+ asks for it
    workdir = str(tmp_path / "run")

    own = Recorder()

    def run(**kwargs):
        return jddp.fit(
            tiny_trainer(), tiny_batches(), workdir=workdir, num_steps=4, log_every=1,
            checkpoint_every=2, writers=(*TRACKERS, own),
            config={"lr": 0.01, "model": {"hidden": 16}}, **kwargs,
        )  # fmt: skip

    with pytest.raises(Stop):
        run(hooks=(stop_at_3,))
    run()

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # step 3's first record replaced
    expected = {
        r["step"]: {
            f"train/{name}": value
            for name, value in r.items()
            if name != "step" and isinstance(value, int | float)
        }
        for r in records
    }
    with open(os.path.join(workdir, "trackers.json")) as f:
        run_ids = json.load(f)

    ids, configs, rows = wandb_history(workdir)
    assert ids == {run_ids["wandb"]} and len(configs) >= 2  # two starts, one W&B run
    logged = [(row["_step"], k, v) for row in rows for k, v in row.items() if "/" in k]
    assert sum(1 for row in rows if row["_step"] == 3) == 2  # before the stop, and again
    assert latest_by_step(logged) == expected
    config = {k: v for c in configs for k, v in c.items()}
    assert config["lr"] == 0.01 and config["model"] == {"hidden": 16}
    assert config["num_steps"] == 4 and config["strategy"] == "ddp"

    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("jddp")
    (only,) = client.search_runs([experiment.experiment_id])
    assert only.info.run_id == run_ids["mlflow"] and only.info.status == "FINISHED"
    assert only.data.params["lr"] == "0.01" and only.data.params["model.hidden"] == "16"
    history = [
        (m.step, name, m.value)
        for name in only.data.metrics
        for m in client.get_metric_history(only.info.run_id, name)
    ]
    assert sum(1 for step, name, _ in history if step == 3 and name == "train/loss") == 2
    assert latest_by_step(history) == expected

    assert latest_by_step(own.entries) == expected and own.closed == 2
    assert own.configs[0] == own.configs[1] and own.configs[0]["lr"] == 0.01


def test_a_tracker_whose_package_is_missing_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # how Python sees an uninstalled package
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as error:
        jddp.fit(tiny_trainer(), tiny_batches(), workdir=str(workdir), num_steps=1,
                 writers=("tensorboard", "mlflow"))  # fmt: skip
    assert_one_line(error, "'mlflow'", "not installed", "pip install 'jddp[mlflow]'")
    assert not workdir.exists()

    config = jddp.default_config()
    config.log.writers = "tensorboard,wandb,mlflow"
    with pytest.raises(ConfigError) as error:
        jddp.run.config.validate(config)
    assert_one_line(error, "log.writers", "jddp[mlflow]")
    config.log.writers = "tensorboard,neptune"
    with pytest.raises(ConfigError) as error:
        jddp.run.config.validate(config)
    assert_one_line(error, "'neptune'", "tensorboard, wandb, mlflow")

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delitem(sys.modules, "mlflow")
    with pytest.raises(ConfigError) as error:  # MLflow 3.7+ refuses a file store unless asked
        jddp.fit(tiny_trainer(), tiny_batches(), workdir=str(workdir), num_steps=1,
                 writers=("mlflow",))  # fmt: skip
    assert_one_line(error, "MLflow cannot log to file:", "MLFLOW_ALLOW_FILE_STORE=true")
    assert not workdir.exists()


def test_a_tracker_that_fails_to_start_stops_the_run_and_leaves_nothing_running(tmp_path):
    workdir = str(tmp_path / "run")
    failing = Recorder()
    failing.write_config = lambda config: 1 / 0  # as a tracker whose server refuses
    with pytest.raises(ZeroDivisionError):
        jddp.fit(tiny_trainer(), tiny_batches(), workdir=workdir, num_steps=2,
                 writers=("tensorboard", failing))  # fmt: skip
    assert failing.closed == 1  # what was opened is closed
    names = [thread.name for thread in threading.enumerate()]
    assert "jddp-hang-watchdog" not in names, names
    with hold_workdir(workdir):  # the workdir's lock was let go
        pass
