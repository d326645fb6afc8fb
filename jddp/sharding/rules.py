"""Partition rules: which mesh axes each parameter is split over.

A rule is `(regex, spec)`: the regex is searched in the parameter's path (`hidden_0/kernel`),
the first rule that matches decides, and the built-in last rule `(".*", "fsdp")` catches the
rest. A spec is one of
- `"fsdp"`: split the largest dimension that divides evenly over the shard axes; tensors with
  fewer than `min_shard_size` elements, or with no dimension that divides, stay replicated;
- `"replicate"`: a full copy on every device;
- one entry per dimension, comma-separated: a mesh axis, `a+b` for several, or `None`
  (e.g. `"shard,None"`, `"None,data"`); missing trailing entries mean `None`.
"""

import math
import re
from collections.abc import Sequence

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp.errors import ConfigError

Rule = tuple[str, str]
DEFAULT_RULES: tuple[Rule, ...] = ((".*", "fsdp"),)


def path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _axis_size(mesh: Mesh, axes) -> int:
    names = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[name] for name in names)


def fsdp_spec(shape, shard_axes: tuple[str, ...], mesh: Mesh, min_shard_size: int) -> P:
    """Split the largest evenly divisible dimension over `shard_axes`, if the tensor is big."""
    count = _axis_size(mesh, shard_axes)
    if count == 1 or math.prod(shape) < min_shard_size:
        return P()
    divisible = [d for d in range(len(shape)) if shape[d] % count == 0]
    if not divisible:
        return P()
    dim = max(divisible, key=lambda d: (shape[d], -d))
    axes = shard_axes[0] if len(shard_axes) == 1 else shard_axes
    return P(*([None] * dim), axes)


def _parse_explicit(spec: str, rule: Rule, mesh: Mesh) -> P:
    entries = []
    for entry in spec.split(","):
        entry = entry.strip()
        if entry in ("None", "none", "-", ""):
            entries.append(None)
            continue
        names = tuple(name.strip() for name in entry.split("+"))
        for name in names:
            if name not in mesh.shape:
                raise ConfigError(
                    f"partition rule {rule!r} names mesh axis {name!r}, but the mesh has axes "
                    f"{', '.join(mesh.axis_names)}; use one of those, 'replicate' or 'fsdp'"
                )
        entries.append(names[0] if len(names) == 1 else names)
    return P(*entries)


def spec_for(path: str, shape, rules: Sequence[Rule], mesh: Mesh, shard_axes, min_size) -> P:
    """The PartitionSpec of one parameter, checked against its shape."""
    for rule in (*rules, *DEFAULT_RULES):
        regex, spec = rule
        if not re.search(regex, path):
            continue
        if spec == "fsdp":
            return fsdp_spec(shape, shard_axes, mesh, min_size)
        if spec == "replicate":
            return P()
        partition = _parse_explicit(spec, rule, mesh)
        if len(partition) > len(shape):
            raise ConfigError(
                f"partition rule {rule!r} gives {len(partition)} entries for parameter {path!r} "
                f"of shape {tuple(shape)}; give at most {len(shape)}"
            )
        for dim, axes in enumerate(partition):
            if axes is not None and shape[dim] % _axis_size(mesh, axes):
                raise ConfigError(
                    f"parameter {path!r} of shape {tuple(shape)}: dimension {dim} (size "
                    f"{shape[dim]}) does not divide over mesh axes {axes} (size "
                    f"{_axis_size(mesh, axes)}) under rule {rule!r}; pick another dimension or "
                    "'replicate'"
                )
        return partition
    raise AssertionError("the default rule matches every path")


def validate_rules(rules: Sequence[Rule], mesh: Mesh) -> tuple[Rule, ...]:
    """The rules as (regex, spec) string pairs; a ConfigError for a malformed pair, a bad regex
    or a mesh axis the mesh does not have."""
    checked = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise ConfigError(
                f"partition rule {rule!r} is not a (regex, spec) pair, e.g. ('head/kernel', "
                "'replicate')"
            )
        try:
            re.compile(rule[0])
        except re.error as e:
            raise ConfigError(f"partition rule {rule!r}: bad regex ({e})") from None
        rule = (str(rule[0]), str(rule[1]))
        if rule[1] not in ("fsdp", "replicate"):
            _parse_explicit(rule[1], rule, mesh)
        checked.append(rule)
    return tuple(checked)


def param_specs(params, rules, mesh: Mesh, shard_axes, min_shard_size: int):
    """A tree of PartitionSpecs shaped like `params` (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: spec_for(path_str(path), x.shape, rules, mesh, shard_axes, min_shard_size),
        params,
    )


def mirror_specs(tree, params, specs):
    """Specs for a tree that holds copies of the parameters (optimizer moments): a leaf whose
    path ends with a parameter's path and has its shape gets that parameter's spec; every other
    leaf (step counts, scalars) is replicated."""
    by_path = {
        path_str(path): (x.shape, spec)
        for (path, x), spec in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(specs), strict=True
        )
    }

    def mirror(path, x):
        text = path_str(path)
        for param_path, (shape, spec) in by_path.items():
            if (text == param_path or text.endswith("/" + param_path)) and x.shape == shape:
                return spec
        return P()

    return jax.tree_util.tree_map_with_path(mirror, tree)
