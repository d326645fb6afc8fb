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

A mixture of experts' stacked expert weights (`experts/{gate,up,down}`, expert first: a path
matching `EXPERT_WEIGHTS`) are split over the `expert` axis on their first dimension when the
mesh has one; their rule lays out the rest of each (one expert's matrix), as a stack's rule
lays out one layer.

Every rule of your own must decide at least one parameter: a regex that matches no path, or only
paths an earlier rule already took, is a ConfigError naming it (a typo would otherwise leave the
weight to the default layout without a word). A model's preset (`adapt_preset`) may match nothing:
it names layers a model may not have (GPT's biases, its learned position table).
"""

import difflib
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
# A mixture of experts' weights stacked by expert (jddp/models/moe.py's names).
EXPERT_WEIGHTS = re.compile(r"(^|/)experts/(gate|up|down)$")


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
            if name == "expert":
                raise ConfigError(
                    f"partition rule {rule!r} names the expert axis, which splits only a mixture "
                    "of experts' experts/{gate,up,down}, on their first dimension, without a "
                    "rule; shard over fsdp or tensor"
                )
            if name not in mesh.axis_names:
                raise ConfigError(
                    f"partition rule {rule!r} names mesh axis {name!r}, but the mesh has axes "
                    f"{', '.join(mesh.axis_names)}; use one of those, 'replicate' or 'fsdp'"
                )
        entries.append(names[0] if len(names) == 1 else names)
    return P(*entries)


class PresetRule(tuple):
    """A `(regex, spec)` rule of a model's preset (`adapt_preset` gives these): it may match no
    parameter, where a rule of the user's own must match one."""


def first_rule(path: str, rules: Sequence[Rule]) -> int:
    """The index in `(*rules, *DEFAULT_RULES)` of the rule that decides `path`."""
    return next(
        i for i, (regex, _) in enumerate((*rules, *DEFAULT_RULES)) if re.search(regex, path)
    )


def spec_for(path: str, shape, rules: Sequence[Rule], mesh: DeviceMesh, min_size: int) -> P:
    """The PartitionSpec of one parameter, checked against its shape."""
    return _layout(first_rule(path, rules), path, shape, rules, mesh, min_size)


def _layout(index: int, path: str, shape, rules, mesh: DeviceMesh, min_size: int) -> P:
    """The PartitionSpec rule `index` gives one parameter; a mixture of experts' stacked
    weights get it for one expert, after their split over `expert`."""
    if not EXPERT_WEIGHTS.search(path):
        return _spec_by(index, path, shape, rules, mesh, min_size)
    check_experts_divide(path, shape[0], mesh)
    split = "expert" if mesh.size("expert") > 1 else None
    return P(split, *_spec_by(index, path, shape[1:], rules, mesh, min_size))


def _spec_by(index: int, path: str, shape, rules, mesh: DeviceMesh, min_size: int) -> P:
    """The PartitionSpec rule `index` of `(*rules, *DEFAULT_RULES)` gives one parameter."""
    rule = (*rules, *DEFAULT_RULES)[index]
    spec = rule[1]
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


def validate_rules(rules: Sequence[Rule], mesh: DeviceMesh) -> tuple[Rule, ...]:
    """The rules as (regex, spec) string pairs; a ConfigError for a malformed pair, a bad regex
    or a mesh axis the mesh does not have."""
    if isinstance(rules, str | dict) or (
        isinstance(rules, tuple | list)
        and len(rules) == 2
        and all(isinstance(r, str) for r in rules)
    ):
        raise ConfigError(
            f"partition rules {rules!r} are not a sequence of (regex, spec) pairs; write them as "
            "one, e.g. rules=(('head/kernel', 'replicate'),) (mind the trailing comma)"
        )
    checked = []
    for rule in rules:
        pair = isinstance(rule, tuple | list) and len(rule) == 2
        if not (pair and all(isinstance(part, str) for part in rule)):
            raise ConfigError(
                f"partition rule {rule!r} is not a (regex, spec) pair of strings, e.g. "
                "('head/kernel', 'replicate')"
            )
        try:
            re.compile(rule[0])
        except re.error as e:
            raise ConfigError(f"partition rule {rule!r}: bad regex ({e})") from None
        rule = PresetRule(rule) if isinstance(rule, PresetRule) else tuple(rule)
        if rule[1] not in ("fsdp", "replicate"):
            _parse_explicit(rule[1], rule, mesh)
        checked.append(rule)
    return tuple(checked)


def adapt_preset(rules: Sequence[Rule], mesh: DeviceMesh) -> tuple[Rule, ...]:
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
        fitted.append(PresetRule((regex, spec)))
    return tuple(fitted)


def param_specs(params, rules, mesh: DeviceMesh, min_shard_size: int, stack_path=()):
    """A tree of PartitionSpecs shaped like `params` (arrays or ShapeDtypeStructs); a
    ConfigError for a rule of the user's own that decides no parameter (see the module doc).

    Parameters under `stack_path` (a `Pipelined` stack: leading axis = layer) get their rule's
    spec for one layer (a mixture of experts' experts split over `expert` too), after a leading
    `stage` (consecutive layers per stage) or None."""
    prefix = "/".join(stack_path) + "/" if stack_path else None
    lead = "stage" if "stage" in mesh.axis_names else None
    decided = {}  # path -> index of the rule that decides it

    def spec(path, x):
        text = path_str(path)
        decided[text] = index = first_rule(text, rules)
        if prefix and text.startswith(prefix):
            return P(lead, *_layout(index, text, x.shape[1:], rules, mesh, min_shard_size))
        return _layout(index, text, x.shape, rules, mesh, min_shard_size)

    specs = jax.tree_util.tree_map_with_path(spec, params)
    check_rules_used(rules, decided)
    return specs


def check_experts_divide(path: str, experts: int, mesh: DeviceMesh) -> None:
    """A ConfigError unless the `experts` of parameter `path` split evenly over the expert axis."""
    size = mesh.size("expert")
    if experts % size:
        raise ConfigError(
            f"parameter {path!r} holds {experts} experts, which do not split evenly over the "
            f"expert axis of parallel.mesh {mesh.describe()!r} (expert:{size}); make "
            f"model_args.moe.num_experts a multiple of {size}, or the expert axis a divisor of "
            f"{experts}"
        )


def check_rules_used(rules: Sequence[Rule], decided: dict[str, int]) -> None:
    """A ConfigError for the first rule (not a preset's) that decides none of the parameters
    (`decided`: path -> index of the rule that decides it), naming the closest paths or the
    earlier rule that takes the paths it matches."""
    used = set(decided.values())
    paths = list(decided)
    for index, rule in enumerate(rules):
        if index in used or isinstance(rule, PresetRule):
            continue
        matched = [path for path in paths if re.search(rule[0], path)]
        if matched:
            earlier = tuple(rules[decided[matched[0]]])
            shown = ", ".join(repr(p) for p in matched[:3])
            raise ConfigError(
                f"partition rule {tuple(rule)!r} decides no parameter: the paths it matches "
                f"({shown}) are taken by the earlier rule {earlier!r} (the first match wins); "
                "move it before that rule, or remove it"
            )
        closest = difflib.get_close_matches(rule[0], paths, n=3, cutoff=0.0)
        raise ConfigError(
            f"partition rule {tuple(rule)!r} matches no parameter; the closest parameter paths "
            f"are {', '.join(repr(p) for p in closest)}; fix its regex (searched in each path), "
            "or remove the rule"
        )


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
