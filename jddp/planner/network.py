"""What one collective costs on the links its mesh axes cross.

Ring formulas, V the whole buffer (an all-reduce's size, an all-gather's result, a
reduce-scatter's input), n devices, B the link's bandwidth per device and direction, a its
latency per ring step, o its overhead per op:

    all-reduce                  2 (n-1)/n V/B + 2 (n-1) a + o
    all-gather, reduce-scatter    (n-1)/n V/B +   (n-1) a + o
    all-to-all                    (n-1)/n V/B +   (n-1) a + o   (V/n to each other device)
    collective-permute                    V/B +         a + o

o is 0 on the accelerator presets (latencies per ring step only: NCCL's for the GPUs). On
XLA:CPU each op also wakes and hands off between its devices' threads whatever the group's
size: a 2-device gloo group inside a process costs 0.4-1.4x a 4-device one between the
calibration GPT's blocks, where the ring steps alone give 1/3 (`experiments.calibrate` measures
both sizes and fits o).

Devices are numbered as the mesh lays them out (the last axis fastest) and filled into hosts of
`devices_per_host` in order. A group inside one host uses the intra-host link; a group with one
device per host the inter-host link; a group spanning several hosts with k devices in each runs
hierarchically, as NCCL and XLA do: reduce-scatter inside the host, all-reduce of the 1/k shard
across hosts (k rings side by side, one per local device), all-gather inside the host.
"""

import dataclasses
import functools
import math
import statistics

import numpy as np

from jddp.planner.layouts import AXES, Layout


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per device and direction
    latency: float  # seconds per ring step
    overhead: float = 0.0  # seconds per op, whatever the group's size


def ring_time(kind: str, volume: float, n: int, link: Link) -> float:
    """Seconds for one collective of `kind` over a ring of `n` devices (see the module doc)."""
    return phases_time(_ring(kind, volume, n, across=False), link, link)


@functools.lru_cache(maxsize=4096)
def group_span(layout: Layout, axes: tuple[str, ...], devices_per_host: int) -> tuple[int, int]:
    """(devices of one group inside each host, hosts the group spans) for the group of mesh
    `axes` that holds device 0."""
    sizes = layout.sizes
    strides = {a: math.prod(sizes[b] for b in AXES[i + 1 :]) for i, a in enumerate(AXES)}
    members = np.zeros(1, np.int64)  # device numbers of the group, one axis at a time
    for a in axes:
        members = np.add.outer(members, np.arange(sizes[a]) * strides[a]).ravel()
    hosts = len(np.unique(members // devices_per_host))
    return len(members) // hosts, hosts


@dataclasses.dataclass(frozen=True)
class Phase:
    """One ring of a collective as it runs: the bytes each device sends in it, its ring steps
    (each paid a link latency), and whether it crosses hosts (the inter-host link) or not."""

    sent: float
    steps: int
    across: bool


def _ring(kind: str, volume: float, n: int, across: bool) -> list[Phase]:
    """The one phase of a flat ring of `n` devices (none for a group of one)."""
    if n <= 1:
        return []
    if kind == "all-reduce":
        return [Phase(2 * (n - 1) / n * volume, 2 * (n - 1), across)]
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return [Phase((n - 1) / n * volume, n - 1, across)]
    if kind == "collective-permute":
        return [Phase(volume, 1, across)]
    raise ValueError(f"unknown collective {kind!r}")


def phases(kind: str, volume: float, local: int, hosts: int) -> list[Phase]:
    """The rings one op of `kind` over a group of `local` devices in each of `hosts` hosts runs
    (V = `volume`, the whole buffer): a flat ring inside one host or with one device per host;
    hierarchically otherwise (the module doc)."""
    n = local * hosts
    if kind == "collective-permute":
        return _ring(kind, volume, 2, across=hosts > 1)
    if hosts == 1 or local == 1:
        return _ring(kind, volume, n, across=hosts > 1)
    if kind == "all-to-all":  # V/n to each other device: local - 1 inside, the rest across
        return [
            Phase((local - 1) / n * volume, local - 1, False),
            Phase((n - local) / n * volume, n - local, True),
        ]
    across = volume / local  # each local device's ring across hosts carries 1/k of it
    if kind == "all-reduce":
        inside = _ring("reduce-scatter", volume, local, False)
        inside += _ring("all-gather", volume, local, False)
        return inside + _ring("all-reduce", across, hosts, True)
    return _ring(kind, volume, local, False) + _ring(kind, across, hosts, True)


def op_phases(
    kind: str, nbytes: float, layout: Layout, axes: tuple[str, ...], devices_per_host: int
) -> list[Phase]:
    """The rings of one op whose result is `nbytes` per device over mesh `axes`."""
    n = math.prod(layout.sizes[a] for a in axes)
    volume = nbytes * n if kind == "reduce-scatter" else nbytes
    return phases(kind, volume, *group_span(layout, axes, devices_per_host))


def phases_time(rings: list[Phase], intra: Link, inter: Link) -> float:
    """Seconds for `rings` run one after the other, each paying its link's per-op overhead."""
    seconds = 0.0
    for ring in rings:
        link = inter if ring.across else intra
        seconds += ring.sent / link.bandwidth + ring.steps * link.latency + link.overhead
    return seconds


def collective_time(
    kind: str,
    nbytes: float,
    layout: Layout,
    axes: tuple[str, ...],
    intra: Link,
    inter: Link,
    devices_per_host: int,
) -> float:
    """Seconds for one op whose result is `nbytes` per device over mesh `axes`."""
    return phases_time(op_phases(kind, nbytes, layout, axes, devices_per_host), intra, inter)


def bytes_across_hosts(rings: list[Phase]) -> float:
    """Bytes one device sends over the inter-host link (the data-center network) in `rings`."""
    return sum(r.sent for r in rings if r.across)


def slowest_of(participants: int) -> float:
    """How far the slowest of `participants` independent, normally distributed step times lies
    above their mean, in standard deviations: the expected maximum of that many standard
    normals, by Blom's approximation Phi^-1((P - 0.375) / (P + 0.25)) (0 for one; 0.56 for 2,
    2.0 for 32, 3.2 for 1,024: it grows like sqrt(2 ln P))."""
    if participants <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((participants - 0.375) / (participants + 0.25))
