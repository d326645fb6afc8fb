"""The collectives both strategy families use inside their per-device programs, and which
platform's implementation they take.

DDP (pmap) and the mesh strategies (shard_map) differ in placement, not in how they talk: these
are the one place where gradients, metrics and model state are averaged, gathered or scattered.

`parallel.collectives` (`Trainer(collectives=...)`) picks, once, when a strategy is built:
`native` is XLA's own collectives as written (GPU, TPU: NCCL and ICI run them well); `cpu` adds
the workarounds XLA:CPU and gloo need (bfloat16 as bit patterns, small tensors packed into flat
buffers across processes, at most 4 steps in flight); `auto` (the default) is `cpu` when the
devices are CPUs and `native` otherwise.
"""

import collections
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jddp.errors import ConfigError

COLLECTIVES = ("auto", "cpu", "native")


def check_collectives(choice) -> None:
    """A one-line ConfigError unless `choice` is one of COLLECTIVES."""
    if choice not in COLLECTIVES:
        raise ConfigError(
            f"parallel.collectives must be one of {', '.join(COLLECTIVES)}, got {choice!r}; "
            "auto takes the CPU workarounds on CPUs and XLA's own collectives on GPUs and TPUs"
        )


def resolve_collectives(choice: str, devices: Sequence[jax.Device]) -> str:
    """The choice to run, "cpu" or "native": `choice` itself, or for "auto" what the platform
    of `devices` wants."""
    check_collectives(choice)
    if choice != "auto":
        return choice
    return "cpu" if all(d.platform == "cpu" for d in devices) else "native"


def spans_devices(axes) -> bool:
    """Whether mesh `axes` (a name, a tuple of names, or None) hold more than one device: over
    one device a collective is the identity, but XLA still emits it and copies through it."""
    return axes is not None and lax.axis_size(axes) > 1


def gather(x, spec: P):
    """The full array from this device's shard: an all-gather of each sharded dimension."""
    for dim, axes in enumerate(spec):
        if spans_devices(axes):
            x = lax.all_gather(x, axes, axis=dim, tiled=True)
    return x


def scatter_sum(x, spec: P):
    """The sum over the devices holding shards of `x`, each keeping its own shard: a
    reduce-scatter of each sharded dimension."""
    for dim, axes in enumerate(spec):
        if spans_devices(axes):
            x = lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
    return x


# Across processes over gloo (the `cpu` choice), a tensor at least this large crosses as its own
# buffer; smaller ones are concatenated into one. gloo pays ~3-5 ms per buffer whatever its size,
# so small tensors are worth joining; concatenating and splitting a tensor of several MB on
# XLA:CPU is a per-element copy that costs more than the buffer it saves (gloo, 2 processes: a
# 42 MB gradient reduces ~1/3 faster with its 8-16 MB kernels apart than as one flat buffer,
# while a 7.4 MB gradient of 3-4 MB kernels is faster flat).
OWN_BUFFER_BYTES = 2**23


def transfer_groups(leaves) -> list[list[int]]:
    """Indices of `leaves` grouped into the buffers that cross processes together: each large
    leaf alone, the others by dtype."""
    groups, small = [], collections.defaultdict(list)
    for i, leaf in enumerate(leaves):
        if leaf.size * leaf.dtype.itemsize >= OWN_BUFFER_BYTES:
            groups.append([i])
        else:
            small[leaf.dtype].append(i)
    return groups + list(small.values())


def concatenated(leaves, indices):
    """The leaves at `indices`, flattened into one vector."""
    return jnp.concatenate([leaves[i].ravel() for i in indices])


def split_into(leaves, indices, flat) -> None:
    """Puts the pieces of `flat` (as `concatenated` made it) back into `leaves` at `indices`."""
    start = 0
    for i in indices:
        size = leaves[i].size
        leaves[i] = flat[start : start + size].reshape(leaves[i].shape).astype(leaves[i].dtype)
        start += size


def fused_pmean(tree, axes, mean=lax.pmean, flat_buffers: bool = False):
    """`lax.pmean` of every float leaf of `tree` over `axes` (other leaves are left as they are);
    `mean(values, axes)` may average another way (a list of leaves, or one flat buffer).

    By default the leaves go to `mean` as they are, and XLA combines them into one tuple
    all-reduce (NCCL and TPUs run it as one operation). With `flat_buffers` (gloo across
    processes: the `cpu` choice there) the leaves under OWN_BUFFER_BYTES are concatenated into
    one flat buffer per dtype, averaged with one all-reduce, and split back; larger ones go as
    their own buffers (`transfer_groups`). gloo pays per buffer: an MLP's 6 gradient tensors
    (7.4 MB) take 31 ms as XLA's combined tuple all-reduce, 14 ms as one buffer
    (experiments/bench/multiprocess.py). Within one process XLA:CPU keeps the tuple all-reduce
    too: there concatenating makes steps 3-4x slower. The sums are the same element by element
    either way.

    Averaging model state (BatchNorm statistics) too keeps replicas identical even when a
    BatchNorm computed per-device statistics; synchronized statistics already agree."""
    if not spans_devices(axes):
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    floats = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    if not flat_buffers:
        averaged = mean([leaves[i] for i in floats], axes)
        for i, leaf in zip(floats, averaged, strict=True):
            leaves[i] = leaf
        return jax.tree.unflatten(treedef, leaves)
    for group in transfer_groups([leaves[i] for i in floats]):
        indices = [floats[g] for g in group]
        split_into(leaves, indices, mean(concatenated(leaves, indices), axes))
    return jax.tree.unflatten(treedef, leaves)
