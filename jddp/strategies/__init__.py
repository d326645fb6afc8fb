"""Data-parallel strategies, by the name `parallel.strategy` gives them.

A strategy owns placement and collectives; it takes the shared core (`jddp.core.Task`) and gives:
`init_state(seed, sample_input)`, `place_state(state)`, `place_batch(batch)`,
`train_step(state, batch) -> (state, metrics)`, `eval_step(state, batch) -> sums`,
`host_state(state)`, `lower_train_step(state, batch)`, `num_devices` and `batch_axis_name`
(the axes a synchronized BatchNorm reduces over inside the per-device program).
"""

import functools
from collections.abc import Sequence

import jax

from jddp.core import Task
from jddp.errors import ConfigError
from jddp.strategies.ddp import DDP
from jddp.strategies.zero import ZeroStrategy

STRATEGIES = {
    "ddp": DDP,
    "zero1": functools.partial(ZeroStrategy, stage="zero1"),
    "zero2": functools.partial(ZeroStrategy, stage="zero2"),
    "zero3": functools.partial(ZeroStrategy, stage="zero3"),
    "fsdp": functools.partial(ZeroStrategy, stage="zero3"),
    "hybrid": functools.partial(ZeroStrategy, stage="hybrid"),
}


def make_strategy(
    name: str,
    task: Task,
    devices: Sequence[jax.Device] | None = None,
    *,
    mesh: str | None = None,
    rules: Sequence[tuple[str, str]] = (),
    min_shard_size: int | None = None,
):
    """The strategy `name`; `mesh`, `rules` and `min_shard_size` configure the sharded ones."""
    if name not in STRATEGIES:
        raise ConfigError(
            f"unknown parallel.strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}"
        )
    if name == "ddp":
        if mesh or rules:
            raise ConfigError(
                "parallel.mesh and parallel.rules do not apply to ddp (every device holds a "
                "full replica); use zero1, zero2, zero3 or hybrid, or leave them empty"
            )
        return DDP(task, devices)
    options = {"mesh": mesh, "rules": rules}
    if min_shard_size is not None:
        options["min_shard_size"] = min_shard_size
    return STRATEGIES[name](task, devices, **options)
