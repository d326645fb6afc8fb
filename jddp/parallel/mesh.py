"""Device meshes whose axes have roles: `parallel.mesh = "data:2,fsdp:2,tensor:2"`.

Each entry is `ROLE:SIZE`, major to minor (the last axis varies fastest over the device list, so
it stays inside a host); one size may be -1 for "the devices left over", and the sizes must
multiply to the device count. The role names are the interface:

    data    the batch is split over it; nothing else is: replicas, gradients all-reduced
    fsdp    the batch is split over it, and the ZeRO stage's state is sharded over it
    tensor  every rank sees the same rows; weight matrices are split by the partition rules
            (Megatron's column / row split) and activations reduced across it
    stage   pipeline stages: each holds a consecutive group of the model's stacked layers
    context every sequence is split along its length over it (context parallelism,
            jddp/parallel/context.py); parameters and optimizer state are not: replicas, as
            over data, gradients averaged
    expert  expert parallelism: a batch axis for everything but a mixture of experts'
            experts, whose stacked weights are split over it (each device holds
            num_experts / size of them); tokens reach their experts by all-to-all
            (jddp/models/moe_dispatch.py)

ddp's mesh is not written: it is one `batch` axis over every device (`ddp_mesh`), the axis its
pmap maps over. The mesh is built once per run, before the model, from the strategy's name and
this string.
"""

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jddp.errors import ConfigError

ROLES = ("data", "fsdp", "tensor", "stage", "context", "expert")
BATCH_ROLES = ("data", "fsdp", "expert")  # axes the batch is split over
# ddp's one axis: its pmap axis name, and the name a synchronized BatchNorm reduces over (Flax's
# convention). Not a role users write: ddp's mesh is always this one axis.
DDP_AXIS = "batch"
_ENTRY = re.compile(r"^\s*([A-Za-z_]\w*)\s*:\s*(-?\d+)\s*$")


def parse_mesh_spec(spec: str, num_devices: int | None = None) -> list[tuple[str, int]]:
    """[(role, size), ...] with -1 resolved against `num_devices` (kept as -1 when it is None);
    a ConfigError names what is wrong and the fix."""
    axes = []
    for entry in spec.split(","):
        match = _ENTRY.match(entry)
        if not match:
            raise ConfigError(
                f"parallel.mesh entry {entry.strip()!r} is not ROLE:SIZE; write e.g. "
                "'fsdp:-1' or 'data:2,fsdp:2,tensor:2'"
            )
        axes.append((match.group(1), int(match.group(2))))
    names = [name for name, _ in axes]
    for name in names:
        if name not in ROLES:
            raise ConfigError(
                f"parallel.mesh {spec!r} names an unknown axis {name!r}; the axes are roles: "
                "data (replicas), fsdp (ZeRO sharding), tensor (tensor parallelism), stage "
                "(pipeline), context (sequences split along their length), expert (a mixture "
                "of experts' experts split over it)"
            )
    if len(set(names)) != len(names):
        raise ConfigError(f"parallel.mesh {spec!r} names an axis twice")
    rest = [name for name, size in axes if size == -1]
    if len(rest) > 1 or any(size == 0 or size < -1 for _, size in axes):
        raise ConfigError(
            f"parallel.mesh {spec!r}: sizes must be positive, with at most one -1 (the rest)"
        )
    if num_devices is None:
        return axes
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


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """A `jax.sharding.Mesh` and what its axes are for; what a strategy and a model share.

    `batch_axes`: the axes the batch is split over (data, fsdp, expert; ddp's `batch`), in mesh
    order; `fsdp_axis`, `tensor_axis`, `stage_axis`, `context_axis`, `expert_axis`: the axis of
    that role, or None.
    Axes of size 1 are kept: a mesh written `data:1,fsdp:1,tensor:1` runs the general path on
    one device."""

    mesh: Mesh

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    def size(self, role: str) -> int:
        return int(self.mesh.shape[role]) if role in self.mesh.shape else 1

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.axis_names if a in (*BATCH_ROLES, DDP_AXIS))

    @property
    def fsdp_axis(self) -> str | None:
        return "fsdp" if "fsdp" in self.mesh.shape else None

    @property
    def tensor_axis(self) -> str | None:
        return "tensor" if "tensor" in self.mesh.shape else None

    @property
    def stage_axis(self) -> str | None:
        return "stage" if "stage" in self.mesh.shape else None

    @property
    def context_axis(self) -> str | None:
        return "context" if "context" in self.mesh.shape else None

    @property
    def expert_axis(self) -> str | None:
        return "expert" if "expert" in self.mesh.shape else None

    @property
    def batch_slices(self) -> int:
        """Into how many slices every global batch is split."""
        return math.prod(self.size(a) for a in self.batch_axes)

    def describe(self) -> str:
        return ",".join(f"{name}:{size}" for name, size in self.mesh.shape.items())

    def row_block(self, process_index: int | None = None) -> tuple[int, int]:
        """(block, blocks): every global batch is cut into `blocks` equal consecutive blocks of
        rows, and the devices of process `process_index` (default: this one) hold the slices
        of block `block`, so that block is the rows the process reads. Processes that differ
        only along tensor, stage or context (pipeline stages on different hosts) hold the same
        slices and read the same rows; with the batch axes across processes, blocks = processes."""
        process = jax.process_index() if process_index is None else process_index
        batch_dims = [self.axis_names.index(a) for a in self.batch_axes]
        batch_shape = [self.mesh.devices.shape[d] for d in batch_dims]
        slices: dict[int, set[int]] = {}
        for position, device in np.ndenumerate(self.mesh.devices):
            coordinates = [position[d] for d in batch_dims]
            index = int(np.ravel_multi_index(coordinates, batch_shape)) if batch_dims else 0
            slices.setdefault(device.process_index, set()).add(index)
        held = sorted(slices.get(process, ()))
        if not held:
            raise ConfigError(
                f"process {process} holds no device of the mesh; give the trainer devices of "
                "every process"
            )
        count = len(held)
        for p, mine in slices.items():
            block = list(range(min(mine), min(mine) + count))
            if sorted(mine) != block or block[0] % count:
                raise ConfigError(
                    f"parallel.mesh {self.describe()!r} gives process {p} batch slices "
                    f"{sorted(mine)}, not one block of {count} consecutive ones like every other "
                    "process, so no split of the rows feeds them; order or size the axes so each "
                    "process holds whole blocks (e.g. 'stage:2,data:3', not 'data:3,stage:2')"
                )
        return held[0] // count, self.batch_slices // count

    def crosses_processes(self, role: str) -> bool:
        """Whether some group of devices along the `role` axis spans several processes (tensor's
        per-layer activation reductions, context's key/value ring, would then cross the
        network)."""
        if role not in self.mesh.shape:
            return False
        devices = np.moveaxis(self.mesh.devices, self.axis_names.index(role), -1)
        groups = devices.reshape(-1, devices.shape[-1])
        return any(len({d.process_index for d in group}) > 1 for group in groups)


def ddp_mesh(devices: Sequence[jax.Device]) -> DeviceMesh:
    """ddp's mesh: one `batch` axis over `devices`, in their order."""
    return DeviceMesh(Mesh(np.asarray(devices), (DDP_AXIS,)))


def by_host(
    devices: Sequence[jax.Device], host_of_process: Sequence[int]
) -> tuple[list[jax.Device], int]:
    """(`devices` host by host, in order of process then device within a host; the number of
    hosts): a mesh whose last axis is the devices of one host, and its first the hosts, reshapes
    this list. A ConfigError when the hosts hold different numbers of the devices."""
    ordered = sorted(devices, key=lambda d: (host_of_process[d.process_index], d.process_index))
    per_host: dict[int, int] = {}
    for device in ordered:
        host = host_of_process[device.process_index]
        per_host[host] = per_host.get(host, 0) + 1
    if len(set(per_host.values())) > 1:
        raise ConfigError(
            f"the hosts hold different numbers of devices ({sorted(per_host.values())}), so no "
            "mesh groups them by host; give every host the same device count, or write "
            "parallel.mesh (e.g. 'fsdp:-1')"
        )
    return ordered, len(per_host)


def build_mesh(
    spec: str,
    devices: Sequence[jax.Device],
    *,
    allow_cross_host_tensor: bool = False,
    allow_cross_host_context: bool = False,
) -> DeviceMesh:
    """The mesh `spec` describes over `devices` (in their order, the last axis fastest)."""
    axes = parse_mesh_spec(spec, len(devices))
    shape = tuple(size for _, size in axes)
    mesh = DeviceMesh(Mesh(np.asarray(devices).reshape(shape), tuple(name for name, _ in axes)))
    check_within_processes(mesh, allow_cross_host_tensor, allow_cross_host_context)
    return mesh


def check_within_processes(mesh: DeviceMesh, allow_tensor: bool, allow_context: bool) -> None:
    """A ConfigError for a tensor or context axis across processes that is not allowed."""
    spec = mesh.describe()
    if mesh.crosses_processes("context") and not allow_context:
        raise ConfigError(
            f"parallel.mesh {spec!r} puts the context axis across processes (its ring passes "
            "keys and values every layer); place context after the axes that span processes, "
            "at most the devices of one process, or set parallel.allow_cross_host_context=true"
        )
    if mesh.crosses_processes("tensor") and not allow_tensor:
        raise ConfigError(
            f"parallel.mesh {spec!r} puts the tensor axis across processes (tensor parallelism "
            "reduces activations every layer); make tensor the last axis and at most the devices "
            "of one process, or set parallel.allow_cross_host_tensor=true"
        )
