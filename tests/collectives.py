"""Reading the collectives out of a compiled program's HLO text."""

import math
import re

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1}
_OP = re.compile(
    r"= (?P<shape>\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?) "
    r"(?P<kind>all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all)\("
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, list[int]]]:
    """(kind, [bytes of each result array]) for every collective op in the program."""
    found = []
    for match in _OP.finditer(hlo_text):
        sizes = [
            DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _ARRAY.findall(match.group("shape"))
        ]
        found.append((match.group("kind"), sizes))
    return found


def total_bytes(ops, kind: str, min_bytes: int = 5) -> int:
    """Bytes of the `kind` results at least `min_bytes` large (skips scalar metric reductions)."""
    return sum(b for k, sizes in ops if k == kind for b in sizes if b >= min_bytes)
