"""Device meshes from a config string: `"data:-1"`, `"replica:2,shard:4"`, `"replica:2,shard:-1"`.

Each entry is `AXIS:SIZE`; one size may be -1 for "the devices left over". The product of the
sizes must equal the number of devices.
"""

import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jddp.errors import ConfigError

_ENTRY = re.compile(r"^\s*([A-Za-z_]\w*)\s*:\s*(-?\d+)\s*$")


def parse_mesh_spec(spec: str, num_devices: int) -> list[tuple[str, int]]:
    """[(axis, size), ...] with -1 resolved; a ConfigError names what is wrong and the fix."""
    axes = []
    for entry in spec.split(","):
        match = _ENTRY.match(entry)
        if not match:
            raise ConfigError(
                f"parallel.mesh entry {entry.strip()!r} is not AXIS:SIZE; write e.g. "
                "'data:-1' or 'replica:2,shard:-1'"
            )
        axes.append((match.group(1), int(match.group(2))))
    names = [name for name, _ in axes]
    if len(set(names)) != len(names):
        raise ConfigError(f"parallel.mesh {spec!r} names an axis twice")
    rest = [name for name, size in axes if size == -1]
    if len(rest) > 1 or any(size == 0 or size < -1 for _, size in axes):
        raise ConfigError(
            f"parallel.mesh {spec!r}: sizes must be positive, with at most one -1 (the rest)"
        )
    known = math.prod(size for _, size in axes if size != -1)
    if rest:
        if num_devices % known:
            raise ConfigError(
                f"parallel.mesh {spec!r}: {num_devices} devices do not divide into axes of "
                f"product {known}; choose sizes whose product divides {num_devices}"
            )
        axes = [(name, num_devices // known if size == -1 else size) for name, size in axes]
    product = math.prod(size for _, size in axes)
    if product != num_devices:
        shape = " x ".join(f"{name}={size}" for name, size in axes)
        raise ConfigError(
            f"parallel.mesh {spec!r} has {shape} = {product} devices but {num_devices} are "
            f"present; make the sizes multiply to {num_devices} or use -1 for one axis"
        )
    return axes


def build_mesh(spec: str, devices: Sequence[jax.Device]) -> Mesh:
    axes = parse_mesh_spec(spec, len(devices))
    shape = tuple(size for _, size in axes)
    return Mesh(np.asarray(devices).reshape(shape), tuple(name for name, _ in axes))
