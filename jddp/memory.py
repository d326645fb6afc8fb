"""Bytes per device: what the state occupies, and the compiled step's peak, from XLA itself."""

import jax


def state_bytes_per_device(state) -> int:
    """Bytes of `state` held by the first local device (its shards; whole arrays if replicated)."""
    device = jax.local_devices()[0]
    total = 0
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


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
