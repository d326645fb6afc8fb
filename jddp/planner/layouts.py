"""The layouts to plan: a strategy on a `data x fsdp x tensor x stage` mesh.

A layout names the mesh axes by role (jddp/parallel/mesh.py), major to minor in the order
`stage, data, fsdp, tensor`: tensor varies fastest over the device list, so it stays inside a
host; stage is outermost, so the pipeline crosses hosts (Megatron-LM's placement).
"""

import dataclasses
import math

AXES = ("stage", "data", "fsdp", "tensor")  # major to minor
STAGES = ("zero1", "zero2", "zero3")
# zero3's state layout: parameters split too (`auto` holds what zero3 holds)
SPLIT_PARAMS = ("zero3", "auto")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A strategy (`ddp`, `zero1`, `zero2`, `zero3`, `auto`) on a mesh of these sizes."""

    strategy: str
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    sequence_parallel: bool = False

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def batch_shards(self) -> int:
        """Into how many slices each global batch is split (data x fsdp)."""
        return self.data * self.fsdp

    @property
    def mesh_spec(self) -> str:
        """`parallel.mesh` for this layout ("batch:N" for ddp, which maps over devices)."""
        if self.strategy == "ddp":
            return f"batch:{self.data}"
        spec = ",".join(f"{a}:{n}" for a, n in self.sizes.items() if n > 1)
        return spec or "fsdp:1"

    @property
    def name(self) -> str:
        return f"{self.strategy} {self.mesh_spec}" + (" +sp" if self.sequence_parallel else "")


def factorizations(devices: int, tensor_limit: int, stages: bool = False) -> list[dict]:
    """Every {stage, data, fsdp, tensor} whose product is `devices`, tensor at most
    `tensor_limit` (the devices of one host); stage only if `stages`. Ordered by tensor, stage,
    then data."""
    divisors = [n for n in range(1, devices + 1) if devices % n == 0]
    meshes = []
    for tensor in (t for t in divisors if t <= tensor_limit):
        for stage in divisors if stages else [1]:
            rest = devices // tensor
            if rest % stage:
                continue
            for data in divisors:
                if (rest // stage) % data == 0:
                    fsdp = rest // stage // data
                    meshes.append({"stage": stage, "data": data, "fsdp": fsdp, "tensor": tensor})
    return sorted(meshes, key=lambda m: (m["tensor"], m["stage"], m["data"]))


def candidates(devices: int, tensor_limit: int, stages: bool = False) -> list[Layout]:
    """ddp, then each ZeRO stage on each mesh where it differs (with fsdp 1 the stages are one
    layout, listed as zero3), and `auto` where fsdp > 1 without stages (it runs no pipeline;
    with fsdp 1 no weight is split for the compiler to choose about); meshes of replicas
    only are ddp's."""
    layouts = [Layout("ddp", data=devices)]
    for mesh in factorizations(devices, tensor_limit, stages):
        if mesh["fsdp"] == 1 and mesh["tensor"] == 1 and mesh["stage"] == 1:
            continue
        for strategy in STAGES if mesh["fsdp"] > 1 else ("zero3",):
            layouts.append(Layout(strategy, **mesh))
        if mesh["fsdp"] > 1 and mesh["stage"] == 1:
            layouts.append(Layout("auto", **mesh))
    return layouts
