"""`jddp.fit`, the one loop of the library and the CLI: the same losses through both and as a
plain optax loop; SIGKILL and Ctrl-C mid-run, then the same call resumes bit for bit from the
step we expect; the workdir lock; damaged metrics lines set aside; `jddp.save` / `jddp.restore`."""

import json
import logging
import os
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.errors import WorkdirError
from jddp.runtime.workdir import hold_workdir
from tests.helpers import assert_one_line, checkout_env, xla_flags

DEADLINE_SEC = 180  # hard limit for any one child process: SIGKILLed past it
TIMING_KEYS = {
    "examples_per_sec",
    "flops_per_sec_per_device",
    "mfu",
    "state_bytes_per_device",
    "peak_bytes_per_device",
    "comm_bytes_per_step",
    "goodput",  # where the wall time went: differs between runs like the speeds
    "goodput_seconds",
}


class TinyMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


def tiny_batches(count=None, rows=32):
    rng = np.random.default_rng(0)
    made = 0
    while count is None or made < count:
        x = rng.normal(size=(rows, 8)).astype(np.float32)
        yield {"image": x, "label": x[:, :4].argmax(1).astype(np.int32)}
        made += 1


def tiny_trainer(**kwargs):
    return jddp.Trainer(TinyMLP(), jddp.losses.softmax_cross_entropy, optax.adam(1e-2), **kwargs)


def records(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = f.read().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


# ------------------------------------------------------------------ (a) the CLI and fit agree
def test_fit_and_the_cli_log_the_same_losses(tmp_path):
    # Imported here: the child processes below import this module, and need none of these.
    from experiments.configs import digits_mlp
    from jddp import data
    from jddp.run.experiment import train_and_evaluate

    config = digits_mlp.get_config()
    config.num_train_steps, config.log_every, config.eval_every = 6, 2, 6
    config.checkpoint_every, config.warmup_steps = 3, 2
    train_and_evaluate(config, str(tmp_path / "cli"))

    # A library user's objects, written out by hand as the config describes them: the MLP,
    # AdamW with warmup + cosine and decay on kernels only, ddp on every device, the data reader.
    schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, warmup_steps=2, decay_steps=6)
    kernels = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731
    optimizer = optax.adamw(schedule, weight_decay=1e-4, mask=kernels)
    model = jddp.models.MLP(num_classes=10, hidden_sizes=(256, 256))
    trainer = jddp.Trainer(model, jddp.losses.softmax_cross_entropy, optimizer)
    splits = data.open_dataset(data.get_dataset("digits"))
    batches = data.train_batches(
        splits.train,
        splits.transform,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
    )
    state = jddp.fit(
        trainer, batches, workdir=str(tmp_path / "fit"), num_steps=6, log_every=2,
        checkpoint_every=3, seed=config.seed,
    )  # fmt: skip
    assert int(state.step) == 6
    cli, fit = records(tmp_path / "cli"), records(tmp_path / "fit")
    assert [r["step"] for r in cli] == [r["step"] for r in fit] == [2, 4, 6]
    assert [r["loss"] for r in cli] == [r["loss"] for r in fit]  # bit for bit
    assert sorted(os.listdir(tmp_path / "fit" / "checkpoints")) == ["3", "6"]


# --------------------------------------------- (c) the same losses as a plain one-device loop
def test_fit_matches_a_plain_single_device_optax_loop(tmp_path):
    batches = list(tiny_batches(8))
    trainer = tiny_trainer()
    start = trainer.init(seed=0, sample_batch=batches[0])
    params = trainer.host_state(start).params
    state = jddp.fit(
        trainer, batches, workdir=str(tmp_path / "run"), num_steps=8, log_every=1,
        checkpoint_every=0, state=start,
    )  # fmt: skip
    losses = [r["loss"] for r in records(tmp_path / "run")]

    optimizer, model = optax.adam(1e-2), TinyMLP()

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, expected = optimizer.init(params), []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        expected.append(float(loss))
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
    final = trainer.host_state(state).params
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), final, params)


# -------------------------------------------- (b, g) SIGKILL and Ctrl-C, then the same call
CHILD = r"""
import os, sys, time
import jax
jax.config.update("jax_disable_most_optimizations", True)
import jddp
from tests.test_loop import tiny_batches, tiny_trainer

workdir, pause_at = sys.argv[1], int(sys.argv[2])

def pause(step, state, record):
    print("step", step, flush=True)
    if step == pause_at:  # once the checkpoint before it has committed: a known resume step
        committed = os.path.join(workdir, "checkpoints", str(step - step % 5))
        deadline = time.monotonic() + 60
        while not os.path.isdir(committed) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("paused", flush=True)
        sys.stdin.readline()

try:
    state = jddp.fit(tiny_trainer(), tiny_batches(), workdir=workdir, num_steps=20, log_every=1,
                     checkpoint_every=5, hooks=[pause])
except KeyboardInterrupt as e:
    print("interrupted:", e, flush=True)
    sys.exit(130)
print("done", int(state.step), flush=True)
"""


def start_child(workdir, pause_at=0):
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(workdir), str(pause_at)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=checkout_env(XLA_FLAGS=xla_flags(2)),
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


def finish(process) -> tuple[int, list[str], str]:
    """(exit code, stdout lines, stderr) of a child, SIGKILLed past the deadline."""
    try:
        out, err = process.communicate(timeout=DEADLINE_SEC)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return process.returncode, out.splitlines(), err


def wait_for_pause(process) -> list[str]:
    """Stdout lines up to the child's "paused" (it then waits on stdin)."""
    seen = []
    killer = _deadline(process)
    try:
        for line in process.stdout:
            seen.append(line.strip())
            if line.strip() == "paused":
                return seen
    finally:
        killer.cancel()
    raise AssertionError(f"the child ended before pausing: {seen} {process.stderr.read()[-2000:]}")


def _deadline(process):
    import threading

    timer = threading.Timer(DEADLINE_SEC, process.kill)
    timer.start()
    return timer


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    code, out, err = finish(start_child(workdir))
    assert code == 0 and out[-1] == "done 20", err[-3000:]
    return workdir


def assert_same_run(workdir, reference):
    assert records(workdir) == records(reference)  # every step, bit-identical floats
    trainer = tiny_trainer()
    sample = next(tiny_batches(1))
    ours, theirs = (
        trainer.host_state(jddp.restore(w, trainer, sample)) for w in (workdir, reference)
    )
    assert int(ours.step) == 20
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)


def test_sigkill_mid_run_then_the_same_call_resumes_from_the_last_checkpoint(
    tmp_path, uninterrupted
):
    workdir = tmp_path / "run"
    process = start_child(workdir, pause_at=12)
    seen = wait_for_pause(process)
    process.kill()
    finish(process)
    assert seen[-2:] == ["step 12", "paused"]
    code, out, err = finish(start_child(workdir))
    assert code == 0, err[-3000:]
    assert out[0] == "step 11" and out[-1] == "done 20"  # resumed from the checkpoint at 10
    assert_same_run(workdir, uninterrupted)


def test_ctrl_c_saves_at_the_step_then_the_same_call_resumes_there(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    process = start_child(workdir, pause_at=12)
    wait_for_pause(process)
    process.send_signal(signal.SIGINT)
    process.stdin.write("\n")
    process.stdin.flush()
    code, out, err = finish(process)
    assert code == 130, err[-3000:]
    assert out[-1].startswith("interrupted: saved a checkpoint at step 12"), out[-3:]
    assert "Traceback" not in err
    assert os.path.isdir(workdir / "checkpoints" / "12")
    code, out, err = finish(start_child(workdir))
    assert code == 0, err[-3000:]
    assert out[0] == "step 13" and out[-1] == "done 20"  # resumed from the step Ctrl-C saved
    assert_same_run(workdir, uninterrupted)


# ------------------------------------------------------------------------ (d) the workdir lock
HOLDER = r"""
import sys
from jddp.runtime.workdir import hold_workdir
with hold_workdir(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_live_run_holding_the_workdir_is_named_and_a_dead_ones_lock_taken_over(tmp_path):
    workdir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(workdir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=checkout_env(JAX_PLATFORMS="cpu"),
    )
    killer = _deadline(holder)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(os.listdir(workdir))
        with pytest.raises(WorkdirError) as error:
            jddp.fit(tiny_trainer(), tiny_batches(3), workdir=str(workdir), num_steps=3)
        assert_one_line(error, "in use", f"process {holder.pid} on", "another workdir")
        assert sorted(os.listdir(workdir)) == before == [".lock"]  # nothing written
        holder.kill()  # dies holding it: the kernel releases its flock, the file stays
        holder.wait()
    finally:
        killer.cancel()
    with hold_workdir(str(workdir)):
        assert open(workdir / ".lock").read().split()[0] == str(os.getpid())
        with pytest.raises(WorkdirError, match=f"process {os.getpid()} on"):
            with hold_workdir(str(workdir)):  # held once per start: a second hold is refused
                pass
    with hold_workdir(str(workdir)):  # released at the end of the first
        pass


# ------------------------------------------------------------ (e) damaged metrics lines
def test_damaged_metrics_lines_are_set_aside_and_complete_records_kept(tmp_path, caplog):
    workdir = tmp_path / "run"
    fit = dict(workdir=str(workdir), log_every=1, checkpoint_every=5)
    jddp.fit(tiny_trainer(), tiny_batches(), num_steps=10, **fit)
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[6] = "\0" * 8 + lines[6]  # NUL bytes a crash left before a complete record (step 7)
    path.write_text("".join(lines) + '{"step": 11, "lo')  # a record cut short
    with caplog.at_level(logging.WARNING):
        jddp.fit(tiny_trainer(), tiny_batches(), num_steps=12, **fit)
    assert [r["step"] for r in records(workdir)] == list(range(1, 13))  # step 7 kept
    damaged = (workdir / "metrics.jsonl.damaged").read_text().splitlines()
    assert damaged == ["\\x00" * 8 + lines[6].strip("\0\n"), '{"step": 11, "lo']
    warnings = [r.getMessage() for r in caplog.records if "damaged line" in r.getMessage()]
    assert len(warnings) == 1 and "metrics.jsonl.damaged" in warnings[0]


# ------------------------------------------------------------------- (f) save and restore
def test_save_and_restore_onto_another_mesh_and_an_existing_step(tmp_path, caplog):
    batches = list(tiny_batches(2))
    writer = tiny_trainer()  # ddp over 8 devices
    state = writer.init(seed=0, sample_batch=batches[0])
    for batch in batches:
        state, _ = writer.step(state, batch)
    path = jddp.save(str(tmp_path / "ckpt"), state, trainer=writer)
    assert path == str(tmp_path / "ckpt" / "2")
    with caplog.at_level(logging.WARNING):
        assert jddp.save(str(tmp_path / "ckpt"), state, trainer=writer) == path  # a no-op
    assert any("already holds step 2" in r.getMessage() for r in caplog.records)

    reader = tiny_trainer(strategy="zero3", devices=jax.devices()[:4], min_shard_size=1)
    restored = jddp.restore(str(tmp_path / "ckpt"), reader, batches[0])
    kernel = restored.params["Dense_0"]["kernel"]
    assert kernel.sharding.mesh.size == 4 and not kernel.sharding.is_fully_replicated
    jax.tree.map(
        np.testing.assert_array_equal, reader.host_state(restored), writer.host_state(state)
    )
    at_step = jddp.restore(str(tmp_path / "ckpt"), reader, batches[0], step=2)
    jax.tree.map(
        np.testing.assert_array_equal, reader.host_state(at_step), writer.host_state(state)
    )
