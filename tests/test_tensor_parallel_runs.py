"""Tensor-parallel runs that outlive one layout or one process: checkpoints restored between
tensor layouts, init_from across them through the experiment path, and two processes with a
tensor axis training what one process trains."""

import sys

import jax
import numpy as np
import pytest

import jddp
from jddp.checkpoints.weights import load_params
from jddp.run.experiment import train_and_evaluate
from tests.helpers import save_and_restore
from tests.reference import (
    TENSOR_RULES,
    TensorNet,
    assert_trees_close,
    make_batches,
    optimizer_for,
    per_example_ce,
    reference_training,
)
from tests.test_gpt import local_corpus
from tests.test_multiprocess import launch, worker_result
from tests.tiny_gpt import gpt_trainer, reference_from, token_batches
from tests.tiny_gpt_config import gpt_config


# ------------------------------------------------------------- checkpoints and processes
@pytest.mark.parametrize(
    "source,target",
    [
        # (into ddp: tests/test_pipeline_runs.py; ddp and ZeRO: tests/test_checkpoint.py)
        (("zero2", "fsdp:4,tensor:2"), ("zero3", "fsdp:2,tensor:4")),
        (("zero3", "tensor:8"), ("zero3", "fsdp:8")),
    ],
)
def test_checkpoints_restore_between_tensor_layouts_exactly(tmp_path, source, target):
    """10 steps in one layout, saved, restored into another (orbax reshards on load): the state
    is bit-identical, and 10 more steps end where 20 steps of one device end."""
    batches = token_batches()
    writer = gpt_trainer(*source)
    state = writer.init(seed=0, sample_batch=batches[0])
    initial = writer.host_state(state).params
    for batch in batches[:10]:
        state, _ = writer.step(state, batch)
    saved = writer.host_state(state)
    reader = gpt_trainer(*target)
    _, state, _ = save_and_restore(writer, state, reader, batches[0], str(tmp_path / "ckpt"))
    jax.tree.map(np.testing.assert_array_equal, reader.host_state(state), saved)
    for batch in batches[10:]:
        state, _ = reader.step(state, batch)
    params, *_ = reference_from("learned", True, initial)
    assert_trees_close(reader.host_state(state).params, params)


def test_two_processes_with_a_tensor_axis_train_what_one_process_trains(tmp_path):
    """2 processes x 2 devices, fsdp:2,tensor:2 (tensor inside each process): the losses and
    final parameters of one process on the same 4 devices, and of the single-device loop."""
    out = str(tmp_path / "result.npz")
    worker = ["-m", "tests.multiprocess_worker", "zero3@fsdp:2,tensor:2", out]
    code, output = launch(2, 2, sys.executable, *worker)
    assert code == 0, output
    initial, final, worker_losses = worker_result(out)
    optimizer, batches = optimizer_for(clip=True), make_batches()
    expected, expected_losses = reference_training(initial, optimizer, batches, TensorNet())
    assert_trees_close(final, expected)
    np.testing.assert_allclose(worker_losses, expected_losses, rtol=1e-5)

    trainer = jddp.Trainer(
        TensorNet(),
        per_example_ce,
        optimizer,
        strategy="zero3",
        mesh=jddp.parallel.strategies.device_mesh_for(
            "zero3", "fsdp:2,tensor:2", jax.devices()[:4]
        ),
        rules=TENSOR_RULES,
        min_shard_size=1,
        grad_accum_steps=2,
    )
    state = trainer.init(seed=0, sample_batch=batches[0])
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(worker_losses, losses, rtol=1e-5)
    assert_trees_close(final, trainer.host_state(state).params)


def test_experiment_trains_a_3d_mesh_and_init_from_crosses_layouts_both_ways(tmp_path):
    """The CLI path (train_and_evaluate) on data:2,fsdp:2,tensor:2 with sequence parallelism;
    then ddp starts from its parameters, and fsdp:2,tensor:4 from ddp's: each run's parameters
    are the ones it was given (a step of learning rate 1e-30 moves nothing but exact zeros)."""
    text = tmp_path / "corpus.txt"
    text.write_text(local_corpus(20_000))
    three_d = tmp_path / "3d"
    summary = train_and_evaluate(
        gpt_config(
            str(text),
            strategy="zero3",
            mesh="data:2,fsdp:2,tensor:2",
            sequence_parallel=True,
        ),
        str(three_d),
    )
    assert summary["eval_loss"] < np.log(128)
    first = (three_d / "metrics.jsonl").read_text().splitlines()[0]
    assert '"state_bytes_per_device"' in first
    ddp, tensor = tmp_path / "ddp", tmp_path / "tensor"
    # Their own checkpoints are never read: ddp starts from the 3-D run's checkpoint, the
    # tensor run from ddp's export (both read into host arrays alike), each checked below.
    ddp_config = gpt_config(str(text), str(three_d), strategy="ddp")
    tensor_config = gpt_config(str(text), str(ddp), strategy="zero1", mesh="fsdp:2,tensor:4")
    ddp_config.checkpoint_every = tensor_config.checkpoint_every = 0
    train_and_evaluate(ddp_config, str(ddp))
    train_and_evaluate(tensor_config, str(tensor))
    for source, target in ((three_d, ddp), (ddp, tensor)):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-25),
            load_params(str(target / "export")),
            load_params(str(source / "export")),
        )
