"""Shared by tests: running the CLI in a real subprocess; training steps with their losses;
programs compiled with full optimization."""

import contextlib
import hashlib
import json
import os
import subprocess
import sys

import jax
import pytest

from jddp.runtime import host_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment (8 simulated devices, the test TFDS data dir) with the checkout
    on PYTHONPATH: `experiments` is not installed, so a child run elsewhere finds it there."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@contextlib.contextmanager
def optimized_compiles():
    """Programs compiled inside compile as users' do (for tests whose run time dominates: a run
    to an accuracy target; measured: a bfloat16 CNN run 42 s optimized, 380 s not)."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def run_cli(*args: str, cwd=REPO, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """`python -m experiments.train ARGS` in `cwd`, in `checkout_env()` (plus `env`); killed after
    `timeout` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=checkout_env(**(env or {})),
    )


def train_steps(trainer, state, batches):
    """`trainer.step` on each batch in turn; returns the state and each step's loss."""
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def train_from(trainer, params, batches):
    """`trainer` trained on `batches` from the given initial `params` (host arrays, e.g. a
    reference's own initialization); returns the state and each step's metrics as floats."""
    state = trainer.replace_state(trainer.init(seed=0, sample_batch=batches[0]), params=params)
    history = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        history.append({name: float(value) for name, value in metrics.items()})
    return state, history


def save_and_restore(writer, state, reader, sample_batch, directory: str, step: int = 10):
    """Saves `state` of `writer` as checkpoint `step` in `directory` and restores it into
    `reader`'s layout (orbax reshards on load; stacked and per-layer blocks convert); returns
    (step, state, meta)."""
    from jddp.checkpoints.store import Checkpoints
    from jddp.run.resume import restore_layout

    checkpoints = Checkpoints(directory, every=step, max_to_keep=2)
    checkpoints.save(step, writer.global_state(state), {"data": None}, force=True)
    checkpoints.wait()
    checkpoints.close()
    checkpoints = Checkpoints(directory, every=step, max_to_keep=2)
    try:
        return checkpoints.restore_latest(
            reader.abstract_state(sample_batch), layout=restore_layout
        )
    finally:
        checkpoints.close()


def snapshot(root) -> dict[str, str]:
    """{path relative to `root`: sha256 of the file, or "dir"} for everything under `root`: equal
    snapshots mean nothing was written, created, removed or moved."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = "dir"
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


@contextlib.contextmanager
def read_only_dir(path):
    """`path` made a directory nobody may write to: a read-only tmpfs where this process may
    mount one (root), else a directory without write permission."""
    os.makedirs(path)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        if os.geteuid() == 0:  # root writes through permissions
            pytest.skip("root, but no tmpfs mount allowed: no read-only directory to test with")
        os.chmod(path, 0o555)
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(path)], check=True)
        else:
            os.chmod(path, 0o755)


def assert_one_line(error, *words) -> None:
    """`error` (a pytest.raises result) is one line holding each of `words`."""
    message = str(error.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def run_in_fresh_process(program: str, **env) -> dict:
    """Runs `program` (Python source printing one JSON line last) in a fresh interpreter on one
    device, with none of this process's malloc settings: the child decides only by `env`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    for name in (host_memory.OPT_OUT, "GLIBC_TUNABLES"):
        environ.pop(name, None)
    environ["XLA_FLAGS"] = ""
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
