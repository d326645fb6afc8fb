"""Data-parallel strategies, by the name `parallel.strategy` gives them.

A strategy owns placement and collectives; it takes the shared core (`jddp.core.Task`) and gives:
`init_state(seed, sample_input)`, `place_state(state)`, `place_batch(batch)`,
`train_step(state, batch) -> (state, metrics)`, `eval_step(state, batch) -> sums`,
`host_state(state)` and `num_devices`.
"""

from collections.abc import Sequence

import jax

from jddp.core import Task
from jddp.errors import ConfigError
from jddp.strategies.ddp import DDP

STRATEGIES = {"ddp": DDP}


def make_strategy(name: str, task: Task, devices: Sequence[jax.Device] | None = None):
    if name not in STRATEGIES:
        raise ConfigError(
            f"unknown parallel.strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}"
        )
    return STRATEGIES[name](task, devices)
