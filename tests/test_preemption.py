"""A second SIGTERM or Ctrl-C during the save that a first one asked for: the save commits, the
run then stops as interrupted (KeyboardInterrupt), and the checkpoint restores to the state the
first signal's step reached."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jddp
from tests.helpers import REPO, checkout_env, xla_flags
from tests.test_loop import DEADLINE_SEC, tiny_batches, tiny_trainer

# `jddp.fit` on the tiny MLP, once with SIGTERM, then with SIGINT: the hook sends the first
# signal at step 3, and the save of that step sends the second just before it commits (the rename
# of its temporary directory, in orbax's background thread, while the loop waits for it).
CHILD = r"""
import os, signal, sys
import jax
jax.config.update("jax_disable_most_optimizations", True)
from orbax.checkpoint._src.path import atomicity
import jddp
from tests.test_loop import tiny_batches, tiny_trainer

commit, signum = atomicity.AtomicRenameTemporaryPath.finalize, None

async def signalled_commit(self, *args, **kwargs):
    if os.path.basename(str(self._final_path)).isdigit():  # a step's directory, not an item
        os.kill(os.getpid(), signum)
    return await commit(self, *args, **kwargs)

atomicity.AtomicRenameTemporaryPath.finalize = signalled_commit

def first_signal(step, state, record):
    if step == 3:
        os.kill(os.getpid(), signum)

for name, workdir in zip(("SIGTERM", "SIGINT"), sys.argv[1:]):
    signum = getattr(signal, name)
    try:
        state = jddp.fit(tiny_trainer(), tiny_batches(), workdir=workdir, num_steps=20,
                         log_every=1, checkpoint_every=100, hooks=[first_signal])
        print(name, "returned", int(state.step), flush=True)
    except KeyboardInterrupt as e:
        print(name, "interrupted:", e, flush=True)
    print(name, "end", file=sys.stderr, flush=True)
"""


@pytest.fixture(scope="module")
def signalled_twice(tmp_path_factory):
    """(exit code, {signal name: (its stdout line, its stderr, its workdir)})."""
    root = tmp_path_factory.mktemp("signalled")
    workdirs = [root / "SIGTERM", root / "SIGINT"]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *map(str, workdirs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=checkout_env(XLA_FLAGS=xla_flags(2)),
        cwd=REPO,
    )
    try:
        out, err = child.communicate(timeout=DEADLINE_SEC)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    lines, errs = out.splitlines(), err.split("SIGTERM end\n")
    results = {}
    for i, name in enumerate(("SIGTERM", "SIGINT")):
        line = lines[i] if i < len(lines) else ""
        results[name] = line, errs[i] if i < len(errs) else "", workdirs[i]
    return child.returncode, results


@pytest.fixture(scope="module")
def three_steps():
    """(the trainer, its host state after 3 steps on the same batches, trained here)."""
    trainer = tiny_trainer()
    batches = list(tiny_batches(3))
    state = trainer.init(seed=0, sample_batch=batches[0])
    for batch in batches:
        state, _ = trainer.step(state, batch)
    return trainer, trainer.host_state(state)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_second_signal_during_the_save_lets_it_commit_then_interrupts(
    signalled_twice, three_steps, name
):
    code, results = signalled_twice
    line, err, workdir = results[name]
    assert code == 0, (code, results)
    assert line.startswith(f"{name} interrupted: saved a checkpoint at step 3"), line
    assert "stopping once the checkpoint save" in err and "has committed" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["3"]  # committed, nothing half-done
    trainer, expected = three_steps
    restored = trainer.host_state(jddp.restore(str(workdir), trainer, next(tiny_batches(1))))
    assert int(restored.step) == 3
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        restored.params,
        expected.params,
    )
