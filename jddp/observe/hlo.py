"""Reading the collectives out of a compiled program's HLO text (`compiled.as_text()`): their
kinds, result sizes, replica groups, and the mesh axes each group spans."""

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

DTYPE_BYTES = {
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "u16": 2,
    "s16": 2,
    "f64": 8,
    "s64": 8,
    "u8": 1,
    "s8": 1,
    "pred": 1,
    "token": 0,  # after-all's ordering token: no data
}
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
_OP = re.compile(
    r"= (?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?) (?P<kind>" + "|".join(KINDS) + r")\("
    r"(?P<rest>.*)$",
    re.MULTILINE,
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:, device_ids=\(?\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\)?)?"
    r"(?: \{(?P<chosen>[^}]*)\})?"
)
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$", re.MULTILINE)
_WHILE = re.compile(r" while\(.*?body=%?([\w.\-]+).*?known_trip_count\":\{\"n\":\"(\d+)\"")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_CALLS = re.compile(
    r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)"
    r"|branch_computations=\{([^}]*)\}"
)
_BRANCHES = re.compile(
    r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
    r"false_computation=%?([\w.\-]+)"
)


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of a compiled program: its kind, the bytes of each result array (one per
    operand of a combined op), its replica groups as device ids (None: every device), and how
    many times a step runs it (the trip counts of the loops around it)."""

    kind: str
    sizes: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...] | None
    executions: int = 1

    @property
    def group_size(self) -> int | None:
        return len(self.groups[0]) if self.groups else None


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str | None) -> list[int]:
    return [int(v) for v in text.split(",") if v] if text else []


def replica_groups(rest: str) -> tuple[tuple[int, ...], ...] | None:
    """The device ids of each replica group in the text after an op's `(`, in any of the
    formats XLA prints: `{{0,1},{2,3}}`, `[2,2]<=[4]` (an iota, maybe transposed), or
    `mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_0'}`. None means one group of
    every device; collective-permutes give their (source, target) pairs."""
    if match := _PAIRS.search(rest):
        return tuple(tuple(_ints(p)) for p in re.findall(r"\{([\d,]+)\}", match.group(1)))
    if match := _EXPLICIT_GROUPS.search(rest):
        groups = re.findall(r"\{([\d,]*)\}", match.group(1))
        return tuple(tuple(_ints(g)) for g in groups if g) or None
    if match := _IOTA_GROUPS.search(rest):
        count, size = int(match.group(1)), int(match.group(2))
        ids = _iota(_ints(match.group(3)), _ints(match.group(4)))
        return tuple(tuple(int(d) for d in row) for row in ids.reshape(count, size))
    if match := _MESH_GROUPS.search(rest):
        axes = re.findall(r"'(\w+)'=(\d+)", match.group("axes"))
        names, shape = [a for a, _ in axes], [int(s) for _, s in axes]
        dims = _ints(match.group("dims")) or [math.prod(shape)]
        mesh = _iota(dims, _ints(match.group("perm"))).reshape(shape)
        chosen = re.findall(r"'(\w+)'", match.group("chosen") or "") or names
        inner = [names.index(a) for a in chosen]
        outer = [i for i in range(len(names)) if i not in inner]
        groups = mesh.transpose(outer + inner).reshape(-1, math.prod(shape[i] for i in inner))
        return tuple(tuple(int(d) for d in row) for row in groups)
    if "replica_groups={}" in rest or "replica_groups=" not in rest:
        return None
    raise ValueError(f"cannot read the replica groups of: {rest[:200]}")


def _array_sizes(shape: str) -> tuple[int, ...]:
    """Bytes of each array of an HLO shape (one array, or a tuple's)."""
    return tuple(
        DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape)
    )


def _executions(hlo_text: str) -> list[tuple[int, int]]:
    """[(offset where a computation starts, how many times a step runs it)], in text order,
    from the `while` loops' known trip counts (a loop inside a loop body multiplies)."""
    starts = [(m.start(), m.group(1)) for m in _COMPUTATION.finditer(hlo_text)]

    def enclosing(offset: int) -> str:
        return next((name for start, name in reversed(starts) if start < offset), "")

    loops = [(enclosing(m.start()), m.group(1), int(m.group(2))) for m in _WHILE.finditer(hlo_text)]
    times = {name: 1 for _, name in starts}
    for _ in loops:  # as many passes as loops: enough for any nesting
        for outer, body, trips in loops:
            times[body] = times.get(outer, 1) * trips
    return [(start, times[name]) for start, name in starts]


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
    """Every collective op of a compiled program, in program order."""
    runs = _executions(hlo_text)
    found = []
    for match in _OP.finditer(hlo_text):
        sizes = _array_sizes(match.group("shape"))
        executions = next((n for start, n in reversed(runs) if start < match.start()), 1)
        groups = replica_groups(match.group("rest"))
        found.append(CollectiveOp(match.group("kind"), sizes, groups, executions))
    return found


def collectives(hlo_text: str, devices: int | None = None) -> list[tuple[str, list[int], int]]:
    """(kind, [bytes of each result array], devices per group) for every collective op; a
    group of every device counts `devices` (default: the module's partition count)."""
    devices = devices or _device_count(hlo_text)
    return [(op.kind, list(op.sizes), op.group_size or devices) for op in collective_ops(hlo_text)]


def _device_count(hlo_text: str) -> int:
    match = re.search(r"num_partitions=(\d+)", hlo_text) or re.search(
        r"replica_count=(\d+)", hlo_text
    )
    return int(match.group(1)) if match else 1


def group_axes(
    groups: tuple[tuple[int, ...], ...] | None,
    mesh_ids: np.ndarray,
    axis_names: Sequence[str],
    pairs: bool = False,
) -> tuple[str, ...]:
    """The mesh axes a collective's groups span: those along which the members of a group
    differ, for a mesh whose device ids are `mesh_ids` (shaped like the mesh, axes
    `axis_names`). None (every device) spans every axis of size > 1. A ValueError if the groups
    are not whole sub-meshes, unless they are a collective-permute's (source, target) `pairs`."""
    if groups is None:
        return tuple(a for a, n in zip(axis_names, mesh_ids.shape, strict=True) if n > 1)
    where = {int(d): index for index, d in np.ndenumerate(mesh_ids)}
    coords = np.array([where[d] for d in groups[0]])
    axes = tuple(a for i, a in enumerate(axis_names) if len(set(coords[:, i])) > 1)
    span = math.prod(mesh_ids.shape[axis_names.index(a)] for a in axes)
    if span != len(groups[0]) and not pairs:
        raise ValueError(f"replica group {groups[0]} is not a sub-mesh of axes {axis_names}")
    return axes


def bytes_by_axes(
    ops: Sequence[CollectiveOp], mesh_ids: np.ndarray, axis_names: Sequence[str], min_bytes=5
) -> dict[tuple[tuple[str, ...], str], int]:
    """{(axes, kind): bytes of the results} over `ops`, results under `min_bytes` (scalars)
    skipped. The bytes are what `total_bytes` counts, split by the mesh axes each op spans."""
    totals: dict[tuple[tuple[str, ...], str], int] = {}
    for op in ops:
        big = op.executions * sum(b for b in op.sizes if b >= min_bytes)
        if big:
            pairs = op.kind == "collective-permute"
            key = (group_axes(op.groups, mesh_ids, axis_names, pairs), op.kind)
            totals[key] = totals.get(key, 0) + big
    return totals


def total_bytes(ops, kind: str, min_bytes: int = 5) -> int:
    """Bytes of the `kind` results at least `min_bytes` large (skips scalar metric reductions)."""
    return sum(b for k, sizes, _ in ops if k == kind for b in sizes if b >= min_bytes)


def ring_bytes(ops, min_bytes: int = 5) -> int:
    """Bytes one device sends per step in ring terms, as the ZeRO paper counts them: an
    all-reduce moves twice its size, a reduce-scatter its input (result x group), an all-gather
    its result. The (N-1)/N factor is left out, as in the paper's formulas; results smaller than
    `min_bytes` (scalar metrics) are skipped."""
    total = 0
    for kind, sizes, group in ops:
        big = sum(b for b in sizes if b >= min_bytes)
        total += {"all-reduce": 2 * big, "reduce-scatter": big * group}.get(kind, big)
    return total


def step_ring_bytes(hlo_text: str, min_bytes: int = 5) -> int:
    """`ring_bytes` of one run of a compiled step: a conditional's branches count as its
    cheapest one (in a jddp step, the only conditional holding collectives is PowerSGD's
    warm-up, whose expensive branch is the uncompressed float32 reduction of the first steps)."""
    bodies, devices = computations(hlo_text), _device_count(hlo_text)
    conditionals = []
    for match in _BRANCHES.finditer(hlo_text):
        names = match.group(1).split(",") if match.group(1) else match.group(2, 3)
        conditionals.append([name.strip().lstrip("%") for name in names])
    in_branches = {name for names in conditionals for name in names}
    total = sum(
        ring_bytes(collectives(body, devices), min_bytes)
        for name, body in bodies.items()
        if name not in in_branches
    )
    for names in conditionals:
        total += min(ring_bytes(collectives(bodies[n], devices), min_bytes) for n in names)
    return total


# ---------------------------------------------------------- which devices, which computation
def computations(hlo_text: str) -> dict[str, str]:
    """{computation name: its text} of an HLO module."""
    headers = list(_COMPUTATION.finditer(hlo_text))
    ends = [h.start() for h in headers[1:]] + [len(hlo_text)]
    return {h.group(1): hlo_text[h.start() : end] for h, end in zip(headers, ends, strict=True)}


def reachable(comps: dict[str, str], roots) -> set[str]:
    """The computations `roots` call, directly or not, and the roots themselves."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for direct, branches in _CALLS.findall(comps[name]):
            todo += [direct] if direct else re.findall(r"%([\w.\-]+)", branches)
    return seen


def collectives_with_groups(hlo_text: str) -> list[tuple[str, int, list | None]]:
    """(kind, bytes of the results, device groups as a list; None: every device) for every
    collective op (a collective-permute's groups are its (source, target) pairs)."""
    return [
        (op.kind, sum(op.sizes), None if op.groups is None else list(op.groups))
        for op in collective_ops(hlo_text)
    ]


# -------------------------------------------------------------------------- memory traffic
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?) "
    r"(?P<op>[\w\-]+)\((?P<operands>.*?)\)(?P<rest>.*)$"
)
# What moves no data of its own (a view, a name, control) or is counted where it runs (a
# loop's body, op by op).
_NO_TRAFFIC = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "while", "call", "conditional",
}  # fmt: skip
_MATMUL = re.compile(r" (?:dot|convolution)\(|custom_call_target=\"[^\"]*(?:matmul|gemm)")


def memory_traffic(hlo_text: str) -> int:
    """Bytes one device's non-matmul ops read and write in one run of a compiled program: each
    op of the entry computation and of its loops' bodies (times their trip counts), neither a
    matmul (a dot, a convolution, or a fusion or library call holding one: those cost FLOPs)
    nor a collective, counted as the bytes of its operands plus its result, as if none stayed
    in a cache. What XLA fused counts once, at the fusion; a conditional's branches are not
    counted (the planner reads programs without them: the calibration GPT's step)."""
    computations: dict[str, list[str]] = {}
    name = entry = None
    for line in hlo_text.splitlines():
        start = _COMPUTATION.match(line)
        if start:
            name = start.group(1)
            computations[name] = []
            entry = name if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            name = None
        elif name:
            computations[name].append(line)
    instructions = {
        n: [m for m in map(_INSTRUCTION.match, lines) if m] for n, lines in computations.items()
    }
    sizes = {m["name"]: sum(_array_sizes(m["shape"])) for ms in instructions.values() for m in ms}
    runs, pending = {entry: 1}, [entry]
    while pending:  # a loop inside a loop's body runs trips x trips
        outer = pending.pop()
        for m in instructions[outer]:
            loop = _WHILE.search(m.group(0))
            if loop:
                runs[loop.group(1)] = runs[outer] * int(loop.group(2))
                pending.append(loop.group(1))
    total = 0
    for comp, times in runs.items():
        for m in instructions[comp]:
            op = m["op"]
            if op in _NO_TRAFFIC or op.removesuffix("-start").removesuffix("-done") in KINDS:
                continue
            called = re.search(r"calls=%?([\w.\-]+)", m["rest"])
            body = "\n".join(computations.get(called.group(1), [])) if called else ""
            if op in ("dot", "convolution") or _MATMUL.search(body + m["rest"]):
                continue
            operands = re.findall(r"%([\w.\-]+)", m["operands"])
            total += times * (sizes[m["name"]] + sum(sizes.get(o, 0) for o in operands))
    return total
