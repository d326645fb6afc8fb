"""What a start reads and decides before the loop: the newest checkpoint's metadata read once per
start (the reads counted), the elastic record of a pipelined run (its micro-batch, counted in
rows per device) kept by a restart on fewer devices, and a task that returns what shaping the
state finds rather than writing it into itself."""

import dataclasses
import json
import subprocess
import sys

import flax.linen as nn
import numpy as np
import optax
import pytest

from jddp.checkpoints import peek
from jddp.checkpoints.newest import NewestCheckpoint
from jddp.core.layer_stacks import Stack
from jddp.core.task import Task
from jddp.parallel.pipeline.layers import Pipelined
from jddp.run import elastic
from jddp.run.experiment import train_and_evaluate
from tests.helpers import REPO, BeforeRerun, checkout_env, small_config, xla_flags
from tests.tiny_gpt_config import gpt_config


@pytest.fixture
def metadata_reads(monkeypatch):
    """The directories whose newest checkpoint's metadata was read (`peek.peek_latest`, the
    one reader of it), in order."""
    reads, read = [], peek.peek_latest

    def counted(directory):
        reads.append(directory)
        return read(directory)

    monkeypatch.setattr(peek, "peek_latest", counted)
    return reads


def test_a_resume_reads_the_newest_checkpoints_metadata_once(tmp_path, metadata_reads):
    """The CLI's path, fresh and then resumed: one read of the newest checkpoint's metadata per
    start (the model's arguments, the elastic accumulation and the resume checks share it), and
    the resume starts at that checkpoint."""
    workdir = str(tmp_path / "run")
    train_and_evaluate(small_config(), workdir)
    assert len(metadata_reads) == 1  # a fresh start looks once, and finds nothing
    before = BeforeRerun(workdir)
    assert before.resume_step == 10
    rerun = small_config(num_train_steps=15, allow_config_change=True)
    train_and_evaluate(rerun, workdir)
    assert metadata_reads[1:] == [f"{workdir}/checkpoints"]  # the resume: once
    before.assert_resumed(log_every=5)


def test_a_pipelined_runs_micro_batch_is_recorded_and_kept_on_fewer_devices(tmp_path):
    """Global batch 16 on stage:2,fsdp:4 with 4 pipeline micro-batches: each device's
    micro-batch is 16 / (4 batch slices x 4 micro-batches) = 1 row, which every checkpoint
    records. Restarted on 4 devices (stage:2,fsdp:2: 2 slices x 4 micro-batches), accumulating
    2 steps keeps it at 1 row (16 / (2 x 4 x 2)), where 1 step would make it 2."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(32 + i % 90) for i in range(5_000)))
    workdir = tmp_path / "run"
    pipeline = {"microbatches": 4, "schedule": "gpipe", "repeats": 1}
    config = gpt_config(str(text), strategy="zero3", mesh="stage:2,fsdp:4", pipeline=pipeline)
    config.model_args.num_layers = 2
    config.num_train_steps = config.checkpoint_every = config.log_every = config.eval_every = 1
    train_and_evaluate(config, str(workdir))
    assert NewestCheckpoint.read(str(workdir)).get(elastic.MICRO_BATCH) == 1

    config_file = tmp_path / "shrunk.py"
    config_file.write_text(
        "from tests.tiny_gpt_config import gpt_config\n\n\ndef get_config():\n"
        f"    config = gpt_config({str(text)!r}, strategy='zero3', mesh='stage:2,fsdp:2',\n"
        f"                        pipeline={pipeline!r})\n"
        "    config.model_args.num_layers = 2\n"
        "    config.num_train_steps, config.allow_config_change = 2, True\n"
        "    config.checkpoint_every = config.log_every = config.eval_every = 1\n"
        "    return config\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--config={config_file}"]
        + [f"--workdir={workdir}"],
        cwd=REPO,
        env=checkout_env(XLA_FLAGS=xla_flags(4)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["elastic"] == {
        "devices": 4,
        "processes": 1,
        "checkpoint_devices": 8,
        "grad_accum_steps": 2,
        "micro_batch_per_device": 1,
    }
    assert NewestCheckpoint.read(str(workdir)).get(elastic.MICRO_BATCH) == 1


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(x.shape[-1])(x))


class _Stacked(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(Pipelined(_Block(name="blocks"), 4)(x))


def test_a_task_returns_where_its_stack_is_and_stays_as_it_was():
    """Shaping the state tells where the model's Pipelined layers are (their parameters' path
    and count, as the parameters themselves show) without writing it into the frozen task."""
    task = Task(model=_Stacked(), loss_fn=lambda out, batch: out.sum(-1), optimizer=optax.sgd(1))
    shapes, stack = task.abstract_state(np.zeros((1, 5), np.float32))
    assert stack == Stack(path=("blocks",), num_layers=4)
    assert shapes.params["blocks"]["Dense_0"]["kernel"].shape == (4, 5, 5)
    assert task.stack is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.stack = stack
