"""Data-parallel strategies, by the name `parallel.strategy` gives them.

A strategy owns placement and collectives; it takes the shared core (`jddp.core.Task`) and gives:
`init_state(seed, sample_input)`, `place_state(state)`, `place_batch(batch)`,
`train_step(state, batch) -> (state, metrics)`, `eval_step(state, batch) -> sums`,
`host_state(state)`, `lower_train_step(state, batch)`, `num_devices` and `batch_axis_name`
(the axes a synchronized BatchNorm reduces over inside the per-device program; models are
built before their strategy, so `batch_axis_name(strategy, mesh)` gives it from the config).
"""

import functools
from collections.abc import Sequence

import jax

from jddp.core import Task
from jddp.errors import ConfigError
from jddp.sharding.mesh import parse_mesh_spec
from jddp.strategies.compression import GradComm
from jddp.strategies.ddp import DDP
from jddp.strategies.zero import ZeroStrategy, default_mesh_spec

STRATEGIES = {
    "ddp": DDP,
    "zero1": functools.partial(ZeroStrategy, stage="zero1"),
    "zero2": functools.partial(ZeroStrategy, stage="zero2"),
    "zero3": functools.partial(ZeroStrategy, stage="zero3"),
    "fsdp": functools.partial(ZeroStrategy, stage="zero3"),
    "hybrid": functools.partial(ZeroStrategy, stage="hybrid"),
}


def _check_name(name: str) -> None:
    if name not in STRATEGIES:
        raise ConfigError(
            f"unknown parallel.strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}"
        )


def batch_axis_name(strategy: str, mesh: str | None = None) -> str | tuple[str, ...]:
    """What `nn.BatchNorm(axis_name=...)` must be under `strategy` (and, for the sharded ones,
    `parallel.mesh`) for statistics over the whole global batch, as PyTorch's SyncBatchNorm
    computes them: "batch" for ddp; the mesh's axis names for the sharded strategies, whose
    per-device program runs under `shard_map` with the batch split over every mesh axis."""
    _check_name(strategy)
    if strategy == "ddp":
        return DDP.batch_axis_name
    stage = STRATEGIES[strategy].keywords["stage"]
    axes = parse_mesh_spec(mesh or default_mesh_spec(stage), jax.device_count())
    names = tuple(name for name, _ in axes)
    return names[0] if len(names) == 1 else names


def make_strategy(
    name: str,
    task: Task,
    devices: Sequence[jax.Device] | None = None,
    *,
    mesh: str | None = None,
    rules: Sequence[tuple[str, str]] = (),
    min_shard_size: int | None = None,
    grad_comm: GradComm | None = None,
):
    """The strategy `name`; `mesh`, `rules` and `min_shard_size` configure the sharded ones,
    `grad_comm` how gradients cross devices (jddp/strategies/compression.py)."""
    _check_name(name)
    grad_comm = grad_comm or GradComm()
    if grad_comm.powersgd and name != "ddp":
        # ZeRO-2/3 shard gradients away, while PowerSGD needs each device's whole gradient and a
        # whole error matrix per device; zero1 could run it but is left out for now.
        raise ConfigError(
            f"parallel.grad_compression=powersgd runs under ddp only, not {name}; use "
            "parallel.strategy=ddp, or grad_comm_dtype=bfloat16 to halve the bytes under ZeRO"
        )
    if name == "ddp":
        if mesh or rules:
            raise ConfigError(
                "parallel.mesh and parallel.rules do not apply to ddp (every device holds a "
                "full replica); use zero1, zero2, zero3 or hybrid, or leave them empty"
            )
        return DDP(task, devices, grad_comm)
    options = {"mesh": mesh, "rules": rules, "grad_comm": grad_comm}
    if min_shard_size is not None:
        options["min_shard_size"] = min_shard_size
    return STRATEGIES[name](task, devices, **options)
