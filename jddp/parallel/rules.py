"""Partition rules: which mesh axes each parameter is split over.

A rule is `(regex, spec)`: the regex is searched in the parameter's path
(`block_0/attn/qkv/kernel`), the first rule that matches decides, and the built-in last rule
`(".*", "fsdp")` catches the rest. A spec is one of
- `"fsdp"`: split the largest dimension that divides evenly over the `fsdp` axis (if the mesh
  has one); tensors with fewer than `min_shard_size` elements, or with no dimension that
  divides, stay replicated;
- `"replicate"`: a full copy on every device;
- one entry per dimension, comma-separated: `fsdp`, `tensor`, `fsdp+tensor` for both, or `None`
  (e.g. `"fsdp,tensor"`: rows over fsdp, columns over tensor — Megatron's column split);
  missing trailing entries mean `None`. The `data` axis replicates and is never named.

A parameter's spec is its whole layout; the strategy decides which part applies where (ZeRO-1/2
keep parameters whole over `fsdp` and shard only the optimizer state and gradients there).
"""

import math
import re
from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

from jddp.core.tree_paths import path_str
from jddp.errors import ConfigError
from jddp.parallel.mesh import DeviceMesh

Rule = tuple[str, str]
DEFAULT_RULES: tuple[Rule, ...] = ((".*", "fsdp"),)
# Elements below which a tensor stays replicated under "fsdp": sharding it would cost a
# collective per step to save a few KiB. The one default of `parallel.min_shard_size`, the
# Trainer's `min_shard_size` and the planner's `Workload.min_shard_size`.
DEFAULT_MIN_SHARD_SIZE = 2**12


def axes_of(entry) -> tuple[str, ...]:
    """The axis names of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def spec_axes(spec: P) -> tuple[str, ...]:
    """Every mesh axis named in `spec`, in order (`P("fsdp", ("data", "tensor"))` gives three)."""
    return tuple(a for entry in spec for a in axes_of(entry))


def restrict(spec: P, keep: Sequence[str]) -> P:
    """`spec` with only the axes in `keep` (the others' dimensions become unsplit)."""
    entries = []
    for entry in spec:
        kept = tuple(a for a in axes_of(entry) if a in keep)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def fsdp_spec(shape, mesh: DeviceMesh, min_shard_size: int) -> P:
    """Split the largest evenly divisible dimension over `fsdp`, if the tensor is big."""
    count = mesh.size("fsdp")
    if count == 1 or math.prod(shape) < min_shard_size:
        return P()
    divisible = [d for d in range(len(shape)) if shape[d] % count == 0]
    if not divisible:
        return P()
    dim = max(divisible, key=lambda d: (shape[d], -d))
    return P(*([None] * dim), "fsdp")


def _parse_explicit(spec: str, rule: Rule, mesh: DeviceMesh) -> P:
    entries = []
    for entry in spec.split(","):
        entry = entry.strip()
        if entry in ("None", "none", "-", ""):
            entries.append(None)
            continue
        names = tuple(name.strip() for name in entry.split("+"))
        for name in names:
            if name == "data":
                raise ConfigError(
                    f"partition rule {rule!r} names the data axis, which only replicates; "
                    "shard over fsdp or tensor"
                )
            if name not in mesh.axis_names:
                raise ConfigError(
                    f"partition rule {rule!r} names mesh axis {name!r}, but the mesh has axes "
                    f"{', '.join(mesh.axis_names)}; use one of those, 'replicate' or 'fsdp'"
                )
        entries.append(names[0] if len(names) == 1 else names)
    return P(*entries)


def spec_for(path: str, shape, rules: Sequence[Rule], mesh: DeviceMesh, min_size: int) -> P:
    """The PartitionSpec of one parameter, checked against its shape."""
    for rule in (*rules, *DEFAULT_RULES):
        regex, spec = rule
        if not re.search(regex, path):
            continue
        if spec == "fsdp":
            return fsdp_spec(shape, mesh, min_size)
        if spec == "replicate":
            return P()
        partition = _parse_explicit(spec, rule, mesh)
        if len(partition) > len(shape):
            raise ConfigError(
                f"partition rule {rule!r} gives {len(partition)} entries for parameter {path!r} "
                f"of shape {tuple(shape)}; give at most {len(shape)}"
            )
        for dim, axes in enumerate(partition):
            size = math.prod(mesh.size(a) for a in axes_of(axes))
            if shape[dim] % size:
                raise ConfigError(
                    f"parameter {path!r} of shape {tuple(shape)}: dimension {dim} (size "
                    f"{shape[dim]}) does not divide over mesh axes {axes} (size {size}) under "
                    f"rule {rule!r}; pick another dimension or 'replicate'"
                )
        return partition
    raise AssertionError("the default rule matches every path")


def validate_rules(rules: Sequence[Rule], mesh: DeviceMesh) -> tuple[Rule, ...]:
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


def fit_preset(rules: Sequence[Rule], mesh: DeviceMesh) -> tuple[Rule, ...]:
    """A preset's rules (written for a mesh with fsdp and tensor) for `mesh`: axes it lacks are
    dropped from the specs, so one preset serves `tensor:8` and `data:2,fsdp:2,tensor:2` alike."""
    fitted = []
    for regex, spec in rules:
        if spec not in ("fsdp", "replicate"):
            entries = []
            for entry in spec.split(","):
                names = [n for n in entry.strip().split("+") if n in mesh.axis_names]
                entries.append("+".join(names) or "None")
            spec = ",".join(entries)
        fitted.append((regex, spec))
    return tuple(fitted)


def param_specs(params, rules, mesh: DeviceMesh, min_shard_size: int, stack_path=()):
    """A tree of PartitionSpecs shaped like `params` (arrays or ShapeDtypeStructs).

    Parameters under `stack_path` (a `Pipelined` stack: leading axis = layer) get their rule's
    spec for one layer, after a leading `stage` (consecutive layers per stage) or None."""
    prefix = "/".join(stack_path) + "/" if stack_path else None
    lead = "stage" if "stage" in mesh.axis_names else None

    def spec(path, x):
        text = path_str(path)
        if prefix and text.startswith(prefix):
            return P(lead, *spec_for(text, x.shape[1:], rules, mesh, min_shard_size))
        return spec_for(text, x.shape, rules, mesh, min_shard_size)

    return jax.tree_util.tree_map_with_path(spec, params)


def mirror_specs(tree, params, specs):
    """Specs for a tree that holds copies of the parameters (optimizer moments): a leaf whose
    path ends with a parameter's path and has its shape gets that parameter's spec (the first
    such parameter's, in parameter order); every other leaf (step counts, scalars) is
    replicated. Each leaf looks up its path's suffixes: linear in the tree's size."""
    by_path = {
        path_str(path): (index, x.shape, spec)
        for index, ((path, x), spec) in enumerate(
            zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(specs), strict=True)
        )
    }

    def mirror(path, x):
        parts = path_str(path).split("/")
        matches = [
            by_path[suffix]
            for suffix in ("/".join(parts[i:]) for i in range(len(parts)))
            if suffix in by_path and by_path[suffix][1] == x.shape
        ]
        return min(matches, key=lambda match: match[0])[2] if matches else P()

    return jax.tree_util.tree_map_with_path(mirror, tree)
