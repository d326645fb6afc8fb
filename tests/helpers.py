"""Shared by tests: running the CLI in a real subprocess; training steps with their losses."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, cwd=REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m experiments.train ARGS` in `cwd`, with this process's environment (8 simulated
    devices, the test TFDS data dir); killed after `timeout` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
    )


def train_steps(trainer, state, batches):
    """`trainer.step` on each batch in turn; returns the state and each step's loss."""
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def save_and_restore(writer, state, reader, sample_batch, directory: str, step: int = 10):
    """Saves `state` of `writer` as checkpoint `step` in `directory` and restores it into
    `reader`'s layout (orbax reshards on load); returns (step, state, meta)."""
    from jddp.checkpoint import Checkpoints

    checkpoints = Checkpoints(directory, every=step, max_to_keep=2)
    checkpoints.save(step, writer.global_state(state), {"data": None}, force=True)
    checkpoints.wait()
    checkpoints.close()
    checkpoints = Checkpoints(directory, every=step, max_to_keep=2)
    try:
        return checkpoints.restore_latest(reader.abstract_state(sample_batch))
    finally:
        checkpoints.close()
