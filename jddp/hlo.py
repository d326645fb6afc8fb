"""Reading the collectives out of a compiled program's HLO text (`compiled.as_text()`)."""

import math
import re

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
}
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
_OP = re.compile(
    r"= (?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?) (?P<kind>" + "|".join(KINDS) + r")\("
    r"(?P<rest>.*)$",
    re.MULTILINE,
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?: \{([^}]*)\})?")
_BRANCHES = re.compile(
    r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
    r"false_computation=%?([\w.\-]+)"
)


def _group_size(rest: str) -> int:
    if "source_target_pairs=" in rest:  # a collective-permute: device to device
        return 2
    if match := _EXPLICIT_GROUPS.search(rest):
        return len(match.group(1).split(","))
    if match := _IOTA_GROUPS.search(rest):
        return int(match.group(2))
    if match := _MESH_GROUPS.search(rest):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", match.group(1)))
        chosen = re.findall(r"'(\w+)'", match.group(2)) if match.group(2) else list(sizes)
        return math.prod(int(sizes[axis]) for axis in chosen)
    raise ValueError(f"cannot read the replica groups of: {rest[:200]}")


def collectives(hlo_text: str) -> list[tuple[str, list[int], int]]:
    """(kind, [bytes of each result array], devices per group) for every collective op."""
    found = []
    for match in _OP.finditer(hlo_text):
        sizes = [
            DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _ARRAY.findall(match.group("shape"))
        ]
        found.append((match.group("kind"), sizes, _group_size(match.group("rest"))))
    return found


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


# ---------------------------------------------------------- which devices, which computation
_HEADER = re.compile(r"^(?:ENTRY )?%?(?P<name>[\w.\-]+) \(", re.MULTILINE)
_CALLS = re.compile(
    r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)"
    r"|branch_computations=\{([^}]*)\}"
)
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def computations(hlo_text: str) -> dict[str, str]:
    """{computation name: its text} of an HLO module."""
    headers = list(_HEADER.finditer(hlo_text))
    ends = [h.start() for h in headers[1:]] + [len(hlo_text)]
    return {
        h.group("name"): hlo_text[h.start() : end] for h, end in zip(headers, ends, strict=True)
    }


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


def device_groups(line: str) -> list[tuple[int, ...]] | None:
    """The groups of device ids a collective's HLO line communicates within (for a
    collective-permute, its source -> target pairs), or None if the format is not read here."""
    if match := _PAIRS.search(line):
        return [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", match.group(1))]
    if match := re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line):
        return [tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]*)\}", match.group(1))]
    if match := _IOTA.search(line):
        count, size = int(match.group(1)), int(match.group(2))
        dims = [int(d) for d in match.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match.group(4):
            ids = ids.transpose([int(p) for p in match.group(4).split(",")])
        return [tuple(row) for row in ids.reshape(count, size).tolist()]
    return None


def collectives_with_groups(hlo_text: str) -> list[tuple[str, int, list | None]]:
    """(kind, bytes of the results, `device_groups`) for every collective op."""
    found = []
    for match in _OP.finditer(hlo_text):
        size = sum(
            DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _ARRAY.findall(match.group("shape"))
        )
        found.append((match.group("kind"), size, device_groups(match.group("rest"))))
    return found


def step_ring_bytes(hlo_text: str, min_bytes: int = 5) -> int:
    """`ring_bytes` of one run of a compiled step: a conditional's branches count as its
    cheapest one (in a jddp step, the only conditional holding collectives is PowerSGD's
    warm-up, whose expensive branch is the uncompressed float32 reduction of the first steps)."""
    bodies = computations(hlo_text)
    conditionals = []
    for match in _BRANCHES.finditer(hlo_text):
        names = match.group(1).split(",") if match.group(1) else match.group(2, 3)
        conditionals.append([name.strip().lstrip("%") for name in names])
    in_branches = {name for names in conditionals for name in names}
    total = sum(
        ring_bytes(collectives(body), min_bytes)
        for name, body in bodies.items()
        if name not in in_branches
    )
    for names in conditionals:
        total += min(ring_bytes(collectives(bodies[name]), min_bytes) for name in names)
    return total
