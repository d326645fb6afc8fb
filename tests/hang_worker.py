"""`python -m experiments.train` with one extra model, `sleepy_mlp`, whose training forward pass
calls a host function that can sleep: the watchdog tests' way to hang a real training process.

Environment (all optional):
- JDDP_TEST_HANG_AT: the training forward call (counted over this process's devices, from 0)
  that sleeps for an hour, in process JDDP_TEST_HANG_PROCESS (default 0), after creating the
  file JDDP_TEST_HANG_MARKER;
- JDDP_TEST_SLOW_FIRST_S: the first training call sleeps this long (a slow first step);
- JDDP_TEST_SLOW_EVAL_S, JDDP_TEST_SLOW_SAVE_S: the first evaluation call, and every
  checkpoint save, take this much longer;
- JDDP_TEST_HANG_AFTER_LOG: the training loop of process JDDP_TEST_HANG_PROCESS sleeps for an
  hour when it logs that step, after creating the marker file: a hang on the host, while the
  other processes go on into the next step's collectives.
"""

import functools
import itertools
import os
import time

import flax.linen as nn
import jax
from absl import app

from experiments import train
from jddp import models
from jddp.checkpoints import store as checkpoint
from jddp.observe.progress import Progress

ENV = os.environ
_calls = itertools.count()
_eval_calls = itertools.count()


def _host_hook(training: bool) -> None:
    if not training:
        if next(_eval_calls) == 0:
            time.sleep(float(ENV.get("JDDP_TEST_SLOW_EVAL_S", 0)))
        return
    call = next(_calls)
    if call == 0:
        time.sleep(float(ENV.get("JDDP_TEST_SLOW_FIRST_S", 0)))
    hang_process = int(ENV.get("JDDP_TEST_HANG_PROCESS", 0))
    if call == int(ENV.get("JDDP_TEST_HANG_AT", -1)) and jax.process_index() == hang_process:
        open(ENV["JDDP_TEST_HANG_MARKER"], "w").close()
        time.sleep(3600)


class SleepyMLP(nn.Module):
    num_classes: int
    hidden_sizes: tuple[int, ...] = (32,)

    @nn.compact
    def __call__(self, x, train: bool = False):
        jax.debug.callback(functools.partial(_host_hook, train))
        x = x.reshape(x.shape[0], -1)
        for width in self.hidden_sizes:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


def _sleepy_progress(update):
    @functools.wraps(update)
    def sleepy(self, step, *args, **kwargs):
        hang_process = int(ENV.get("JDDP_TEST_HANG_PROCESS", 0))
        if step == int(ENV.get("JDDP_TEST_HANG_AFTER_LOG", -1)):
            if jax.process_index() == hang_process:
                open(ENV["JDDP_TEST_HANG_MARKER"], "w").close()
                time.sleep(3600)
        return update(self, step, *args, **kwargs)

    return sleepy


def _slow_save(save):
    @functools.wraps(save)
    def slow(*args, **kwargs):
        time.sleep(float(ENV.get("JDDP_TEST_SLOW_SAVE_S", 0)))
        return save(*args, **kwargs)

    return slow


if __name__ == "__main__":
    models.MODELS["sleepy_mlp"] = SleepyMLP
    checkpoint.Checkpoints.save = _slow_save(checkpoint.Checkpoints.save)
    Progress.update = _sleepy_progress(Progress.update)
    app.run(train.main, flags_parser=train.CONFIG.parse)
