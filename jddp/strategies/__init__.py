"""Data-parallel strategies, by the name `parallel.strategy` gives them.

A strategy owns placement and collectives; it takes the shared core (`jddp.core.Task`) and gives:
`init_state(seed, sample_input)`, `place_state(state)`, `place_batch(batch)`,
`train_step(state, batch) -> (state, metrics)`, `eval_step(state, batch) -> sums`,
`host_state(state)` and `num_devices`; and, as a class attribute, `batch_axis_name`: the axis a
model's BatchNorm must name to see global-batch statistics (None when it needs none).
"""

from collections.abc import Sequence

import jax

from jddp.core import Task
from jddp.errors import ConfigError
from jddp.strategies.ddp import DDP

STRATEGIES = {"ddp": DDP}


def _check_name(name: str) -> None:
    if name not in STRATEGIES:
        raise ConfigError(
            f"unknown parallel.strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}"
        )


def batch_axis_name(strategy: str) -> str | None:
    """What `nn.BatchNorm(axis_name=...)` must be under `strategy` for statistics over the whole
    global batch (PyTorch's SyncBatchNorm): "batch" for ddp, None for the mesh strategies."""
    _check_name(strategy)
    return STRATEGIES[strategy].batch_axis_name


def make_strategy(name: str, task: Task, devices: Sequence[jax.Device] | None = None):
    _check_name(name)
    return STRATEGIES[name](task, devices)
