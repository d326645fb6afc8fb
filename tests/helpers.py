"""Shared by tests: running the CLI in a real subprocess; training steps with their losses."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment (8 simulated devices, the test TFDS data dir) with the checkout
    on PYTHONPATH: `experiments` is not installed, so a child run elsewhere finds it there."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


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
