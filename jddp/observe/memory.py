"""Bytes per device: what the state occupies, and the compiled step's peak, from XLA itself."""

import math

import jax

from jddp.parallel.rules import spec_axes


def state_bytes_per_device(state) -> int:
    """Bytes of `state` held by the first local device (its shards; whole arrays if replicated)."""
    device = jax.local_devices()[0]
    total = 0
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def sharded_bytes(tree, specs, mesh_shape) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) laid out by `specs`
    (PartitionSpecs) over a mesh of `mesh_shape` ({axis: size}): computed, nothing placed."""

    def shard_bytes(x, spec):
        split = math.prod(mesh_shape[a] for a in spec_axes(spec))
        return x.size * x.dtype.itemsize // split

    return sum(jax.tree.leaves(jax.tree.map(shard_bytes, tree, specs)))


def peak_bytes(compiled) -> int:
    """A compiled program's peak bytes per device by XLA's memory analysis: arguments and outputs
    (donated buffers counted once) plus temporaries."""
    analysis = compiled.memory_analysis()
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError
