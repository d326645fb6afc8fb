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
import itertools
import math

from jddp.planner.layouts import AXES, Layout


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per device and direction
    latency: float  # seconds per ring step
    overhead: float = 0.0  # seconds per op, whatever the group's size


def ring_time(kind: str, volume: float, n: int, link: Link) -> float:
    """Seconds for one collective of `kind` over a ring of `n` devices (see the module doc)."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        ring = 2 * (n - 1) / n * volume / link.bandwidth + 2 * (n - 1) * link.latency
    elif kind in ("all-gather", "reduce-scatter", "all-to-all"):
        ring = (n - 1) / n * volume / link.bandwidth + (n - 1) * link.latency
    elif kind == "collective-permute":
        ring = volume / link.bandwidth + link.latency
    else:
        raise ValueError(f"unknown collective {kind!r}")
    return ring + link.overhead


@functools.lru_cache(maxsize=4096)
def group_span(layout: Layout, axes: tuple[str, ...], devices_per_host: int) -> tuple[int, int]:
    """(devices of one group inside each host, hosts the group spans) for the group of mesh
    `axes` that holds device 0."""
    sizes = layout.sizes
    strides = {a: math.prod(sizes[b] for b in AXES[i + 1 :]) for i, a in enumerate(AXES)}
    members = [
        sum(j * strides[a] for j, a in zip(index, axes, strict=True))
        for index in itertools.product(*(range(sizes[a]) for a in axes))
    ]
    hosts = len({m // devices_per_host for m in members})
    return len(members) // hosts, hosts


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
    n = math.prod(layout.sizes[a] for a in axes)
    volume = nbytes * n if kind == "reduce-scatter" else nbytes
    local, hosts = group_span(layout, axes, devices_per_host)
    if kind == "collective-permute":
        return ring_time(kind, volume, 2, intra if hosts == 1 else inter)
    if hosts == 1:
        return ring_time(kind, volume, n, intra)
    if local == 1:
        return ring_time(kind, volume, n, inter)
    if kind == "all-to-all":  # V/n to each other device: local - 1 inside, the rest across
        inside = (local - 1) / n * volume / intra.bandwidth + (local - 1) * intra.latency
        across = (n - local) / n * volume / inter.bandwidth + (n - local) * inter.latency
        return inside + intra.overhead + across + inter.overhead
    across = volume / local  # each local device's ring across hosts carries 1/k of it
    if kind == "all-reduce":
        inside = ring_time("reduce-scatter", volume, local, intra)
        inside += ring_time("all-gather", volume, local, intra)
        return inside + ring_time("all-reduce", across, hosts, inter)
    return ring_time(kind, volume, local, intra) + ring_time(kind, across, hosts, inter)
