"""Strategies by the name `parallel.strategy` gives them, and the mesh each one runs on.

A run builds its mesh first (`device_mesh_for`), then the model (which takes its axis names from
the mesh), then the strategy (`make_strategy`). What callers may use of a strategy is the
`Strategy` protocol in jddp/parallel/protocol.py.
"""

import functools
import warnings
from collections.abc import Sequence

import jax

from jddp.core.task import Task
from jddp.errors import ConfigError
from jddp.parallel.auto import AutoStrategy
from jddp.parallel.ddp import DDP
from jddp.parallel.grad_reduction import GradComm
from jddp.parallel.mesh import (
    BATCH_ROLES,
    DDP_AXIS,
    DeviceMesh,
    build_mesh,
    by_host,
    ddp_mesh,
    parse_mesh_spec,
)
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.protocol import Strategy
from jddp.parallel.rules import DEFAULT_MIN_SHARD_SIZE
from jddp.parallel.zero import (
    STAGE_OF,
    ZeroStrategy,
    check_mesh_for,
    default_mesh_spec,
    unsharded_warning,
)
from jddp.runtime.processes import host_of_processes

STRATEGIES = ("ddp", *STAGE_OF)  # ddp, zero1, zero2, zero3, fsdp (= zero3), hybrid, auto

__all__ = [
    "DDP_AXIS",
    "STRATEGIES",
    "Strategy",
    "batch_axis_name",
    "device_mesh_for",
    "make_strategy",
]


def _check_name(name: str) -> None:
    if name not in STRATEGIES:
        raise ConfigError(
            f"unknown parallel.strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}"
        )


def device_mesh_for(
    name: str,
    mesh: str | None = None,
    devices: Sequence[jax.Device] | None = None,
    *,
    allow_cross_host_tensor: bool = False,
    allow_cross_host_context: bool = False,
) -> DeviceMesh:
    """The mesh strategy `name` runs on (`mesh` like "data:2,fsdp:2,tensor:2", or the strategy's
    default: hybrid's `data:<hosts>,fsdp:<devices per host>` over the devices host by host, the
    others' `fsdp:-1`), over `devices` (default: every device of every process); for ddp, one
    `batch` axis over the devices, which its pmap maps over. A tensor axis across processes is
    refused unless `allow_cross_host_tensor`, a context axis unless
    `allow_cross_host_context`."""
    _check_name(name)
    devices = devices or jax.devices()
    if name == "ddp":
        if mesh:
            raise ConfigError(
                "parallel.mesh does not apply to ddp (every device holds a full replica); use "
                "zero1, zero2, zero3 or hybrid, or leave it empty"
            )
        return ddp_mesh(devices)
    if not mesh and name == "hybrid":  # fsdp within a host, replicas across hosts
        devices, hosts = by_host(devices, host_of_processes())
        mesh = default_mesh_spec(name, hosts)
    device_mesh = build_mesh(
        mesh or default_mesh_spec(name),
        devices,
        allow_cross_host_tensor=allow_cross_host_tensor,
        allow_cross_host_context=allow_cross_host_context,
    )
    check_mesh_for(name, device_mesh)
    return device_mesh


def batch_axis_name(strategy: str, mesh: str | None = None) -> str | tuple[str, ...]:
    """What `nn.BatchNorm(axis_name=...)` names for statistics over the whole global batch (as
    PyTorch's SyncBatchNorm computes them): "batch" for ddp; the mesh's batch axes (`data`,
    `fsdp`) for the mesh strategies. Only the axis names of `mesh` are read, not its sizes.
    Writing `axis_name="batch"` (the Flax convention) works under every strategy as well."""
    _check_name(strategy)
    if strategy == "ddp":
        return DDP_AXIS
    axes = parse_mesh_spec(mesh or default_mesh_spec(strategy))
    return tuple(name for name, _ in axes if name in BATCH_ROLES)


def make_strategy(
    name: str,
    task: Task,
    mesh: DeviceMesh,
    *,
    rules: Sequence[tuple[str, str]] = (),
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    pipeline: PipelineOptions | None = None,
    grad_comm: GradComm | None = None,
) -> Strategy:
    """The strategy `name` for `task` on `mesh` (from `device_mesh_for`); `rules` and
    `min_shard_size` lay out the mesh strategies' parameters; `pipeline` says how a stage axis
    is used; `grad_comm` how gradients cross devices (jddp/parallel/grad_reduction.py)."""
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
        if rules:
            raise ConfigError(
                "parallel.rules do not apply to ddp (every device holds a full replica); use "
                "zero1, zero2, zero3 or hybrid, or leave them empty"
            )
        return DDP(task, mesh, grad_comm)
    warning = unsharded_warning(name, mesh, len(set(host_of_processes())))
    if warning and jax.process_index() == 0:
        warnings.warn(warning, stacklevel=3)
    strategy = AutoStrategy if name == "auto" else functools.partial(ZeroStrategy, name=name)
    return strategy(
        task,
        mesh,
        rules=rules,
        min_shard_size=min_shard_size,
        pipeline=pipeline,
        grad_comm=grad_comm,
    )
