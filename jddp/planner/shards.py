"""Which mesh axes each parameter, gradient and optimizer moment is split over under a layout:
the partition rules of jddp/parallel/rules.py applied to an abstract mesh (no devices), and the
ZeRO stage's choice among them, as jddp/parallel/zero.py makes it:

    zero1   parameters and gradients whole over fsdp, optimizer state split as the rules say
    zero2   gradients split too
    zero3   parameters split too
    (every stage splits over tensor what the rules split over tensor, and a mixture of experts'
    experts over expert; ddp splits nothing)

Computed once per workload and (fsdp, tensor, expert) size: the planner asks for thousands of
layouts.
"""

import dataclasses
import functools
import math

import jax
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jddp.core.tree_paths import nest_paths, path_str
from jddp.parallel.mesh import DeviceMesh
from jddp.parallel.rules import (
    check_rules_used,
    first_rule,
    mirror_specs,
    spec_axes,
    spec_for,
    validate_rules,
)
from jddp.planner.layouts import AXES, Layout
from jddp.planner.workload import Workload, block_index

# The axes every ZeRO stage splits a parameter over as its spec says (fsdp depends on the stage).
RULE_AXES = ("tensor", "expert")


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """One parameter of the device's pipeline stage: its path, its size, and its whole layout
    (`spec`, over fsdp, tensor and expert)."""

    path: str
    elements: int
    itemsize: int
    spec: P
    axes: tuple[str, ...] = ()  # the mesh axes `spec` names
    block: int | None = None  # the transformer block it belongs to
    shape: tuple[int, ...] = ()  # its whole shape
    trains: bool = True  # False: frozen (LoRA's base), without gradient or optimizer state

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize

    def split_over(self, axis: str) -> bool:
        return axis in self.axes

    def split(self, sizes: dict[str, int], axes=("fsdp", "tensor", "expert")) -> int:
        """Into how many parts a mesh of `sizes` splits it over `axes` (those its spec names)."""
        return math.prod(sizes[a] for a in self.axes if a in axes)


def abstract_mesh(layout: Layout) -> DeviceMesh:
    """The layout's mesh without devices (what partition rules need: axis names and sizes)."""
    axes = [a for a in AXES if a != "stage" and layout.sizes[a] > 1] or ["fsdp"]
    return DeviceMesh(AbstractMesh(tuple(layout.sizes[a] for a in axes), tuple(axes)))


def check_rules(workload: Workload) -> None:
    """The trainer's checks of the partition rules, made once before any layout: a ConfigError
    for a malformed rule, or for a rule of your own that decides no parameter (which paths a
    rule matches does not depend on the mesh; a preset's rules may match nothing)."""
    mesh = abstract_mesh(Layout("zero3", data=2, fsdp=2, tensor=2))  # every axis a rule names
    rules = validate_rules(workload.rules_for(mesh), mesh)
    decided = {path: first_rule(path, rules) for path, _, _ in _param_table(workload)}
    check_rules_used(rules, decided)


def on_first_stage(shard: "ParamShard", workload: Workload, stages: int) -> bool:
    """Whether a parameter lives on the first of `stages` pipeline stages (blocks split evenly;
    the embedding, positions and final norm and head counted there too: the most loaded stage
    of a tied model)."""
    if shard.block is None or stages == 1:
        return True
    return shard.block < workload.transformer.layers // stages


@functools.lru_cache(maxsize=64)
def _param_table(workload: Workload) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    """(path, shape, bytes per element) of every parameter, in tree order."""
    leaves = jax.tree_util.tree_leaves_with_path(workload.params)
    return tuple((path_str(p), tuple(x.shape), x.dtype.itemsize) for p, x in leaves)


@functools.lru_cache(maxsize=64)
def optimizer_table(workload: Workload) -> tuple[tuple[int | None, int], ...]:
    """(index of the parameter a leaf mirrors, or None, its bytes) for every optimizer-state
    leaf: the mapping of jddp.parallel.rules.mirror_specs, computed once (the default state is
    Adam's two float32 moments per trainable parameter)."""
    table = _param_table(workload)
    if workload.opt_state is None:
        return tuple(
            (i, 4 * math.prod(shape))
            for i, (path, shape, _) in enumerate(table)
            if path not in workload.frozen_params
            for _ in "mv"
        )
    params = workload.params
    markers = jax.tree.unflatten(
        jax.tree.structure(params), [P(f"param{i}") for i in range(len(table))]
    )
    if workload.frozen_params:  # the state mirrors the trainable parameters alone
        leaves = zip(table, jax.tree.leaves(params), strict=True)
        trains = [
            (path, leaf, P(f"param{i}"))
            for i, ((path, _, _), leaf) in enumerate(leaves)
            if path not in workload.frozen_params
        ]
        params = nest_paths({path: leaf for path, leaf, _ in trains})
        markers = nest_paths({path: marker for path, _, marker in trains})
    mirrored = jax.tree.leaves(
        mirror_specs(workload.opt_state, params, markers),
        is_leaf=lambda x: isinstance(x, P),
    )
    leaves = jax.tree.leaves(workload.opt_state)
    return tuple(
        (int(spec[0][5:]) if len(spec) else None, x.size * x.dtype.itemsize)
        for spec, x in zip(mirrored, leaves, strict=True)
    )


@functools.lru_cache(maxsize=512)
def _specs(workload: Workload, fsdp: int, tensor: int, expert: int) -> tuple[P, ...]:
    """Each parameter's spec by the rules, as the strategies get them (jddp.parallel.rules.spec_for,
    as param_specs: experts split over expert too), from the cached table of paths and shapes
    rather than the parameter tree (mapping a large model's tree costs the planner a third)."""
    mesh = abstract_mesh(Layout("zero3", fsdp=fsdp, tensor=tensor, expert=expert))
    rules = workload.rules_for(mesh)
    return tuple(
        spec_for(path, shape, rules, mesh, workload.min_shard_size)
        for path, shape, _ in _param_table(workload)
    )


def all_shards(workload: Workload, layout: Layout) -> tuple[ParamShard, ...]:
    """Every parameter with its whole layout (all replicated under ddp); a ConfigError if the
    rules do not fit the mesh."""
    return _all_shards(
        workload, layout.strategy == "ddp", layout.fsdp, layout.tensor, layout.expert
    )


@functools.lru_cache(maxsize=1024)
def _all_shards(workload: Workload, ddp: bool, fsdp: int, tensor: int, expert: int):
    table = _param_table(workload)
    specs = (P(),) * len(table) if ddp else _specs(workload, fsdp, tensor, expert)
    frozen = workload.frozen_params
    return tuple(
        ParamShard(
            path,
            math.prod(shape),
            itemsize,
            spec,
            spec_axes(spec),
            block_index(path),
            shape,
            path not in frozen,
        )
        for (path, shape, itemsize), spec in zip(table, specs, strict=True)
    )


def param_shards(workload: Workload, layout: Layout) -> tuple[ParamShard, ...]:
    """The parameters of the device's (first) pipeline stage, with their whole layouts."""
    return _stage_shards(
        workload, layout.strategy == "ddp", layout.fsdp, layout.tensor, layout.expert, layout.stage
    )


@functools.lru_cache(maxsize=4096)
def _stage_shards(workload: Workload, ddp: bool, fsdp: int, tensor: int, expert: int, stage: int):
    shards = _all_shards(workload, ddp, fsdp, tensor, expert)
    return tuple(s for s in shards if on_first_stage(s, workload, stage))
