"""The layouts to plan: a strategy on a `data x expert x fsdp x context x tensor x stage` mesh.

A layout names the mesh axes by role (jddp/parallel/mesh.py), major to minor in the order
`stage, data, expert, fsdp, context, tensor`: tensor varies fastest over the device list, so it
stays inside a host; context next, so its ring (a key/value block every layer, twice per hop
backward) stays inside a host as long as context x tensor fits one (jddp refuses a context axis
across processes by default); stage is outermost, so the pipeline crosses hosts (Megatron-LM's
placement). A mixture of experts' `expert` axis (planned for MoE models only, sizes dividing
the experts) sits outside fsdp, as meshes are written for it (`expert:4,fsdp:2`).
"""

import dataclasses
import math

AXES = ("stage", "data", "expert", "fsdp", "context", "tensor")  # major to minor
STAGES = ("zero1", "zero2", "zero3")
# zero3's state layout: parameters split too (`auto` holds what zero3 holds)
SPLIT_PARAMS = ("zero3", "auto")
CONTEXT_ATTENTIONS = ("ring", "all_gather")  # jddp/parallel/context.py


@dataclasses.dataclass(frozen=True)
class Layout:
    """A strategy (`ddp`, `zero1`, `zero2`, `zero3`, `auto`) on a mesh of these sizes; with a
    context axis, its attention (`parallel.context_attention`); `expert`: a mixture of
    experts' expert axis (a batch axis that splits the experts)."""

    strategy: str
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    sequence_parallel: bool = False
    context: int = 1
    context_attention: str = "ring"
    expert: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def batch_slices(self) -> int:
        """Into how many slices each global batch is split (data x expert x fsdp)."""
        return self.data * self.expert * self.fsdp

    @property
    def mesh_spec(self) -> str:
        """`parallel.mesh` for this layout ("batch:N" for ddp, which maps over devices)."""
        if self.strategy == "ddp":
            return f"batch:{self.data}"
        spec = ",".join(f"{a}:{n}" for a, n in self.sizes.items() if n > 1)
        return spec or "fsdp:1"

    @property
    def name(self) -> str:
        gathered = self.context > 1 and self.context_attention == "all_gather"
        return (
            f"{self.strategy} {self.mesh_spec}"
            + (" +sp" if self.sequence_parallel else "")
            + (" +all_gather" if gathered else "")
        )


def factorizations(
    devices: int, tensor_limit: int, stages: bool = False, contexts: bool = False
) -> list[dict]:
    """Every {stage, data, fsdp, context, tensor} whose product is `devices`, tensor at most
    `tensor_limit` (the devices of one host), context x tensor too (the ring stays in a host);
    stage only if `stages`, context only if `contexts`. Ordered by context, tensor, stage, then
    data."""
    divisors = [n for n in range(1, devices + 1) if devices % n == 0]
    meshes = []
    for tensor in (t for t in divisors if t <= tensor_limit):
        for context in divisors if contexts else [1]:
            if context * tensor > tensor_limit and context > 1:
                continue
            for stage in divisors if stages else [1]:
                rest = devices // (tensor * context) if devices % (tensor * context) == 0 else 0
                if not rest or rest % stage:
                    continue
                for data in divisors:
                    if (rest // stage) % data == 0:
                        fsdp = rest // stage // data
                        meshes.append(
                            {"stage": stage, "data": data, "fsdp": fsdp, "tensor": tensor}
                            | ({"context": context} if contexts else {})
                        )
    return sorted(meshes, key=lambda m: (m.get("context", 1), m["tensor"], m["stage"], m["data"]))


def candidates(
    devices: int,
    tensor_limit: int,
    stages: bool = False,
    contexts: bool = False,
    experts: int = 0,
) -> list[Layout]:
    """ddp, then each ZeRO stage on each mesh where it differs (with fsdp 1 the stages are one
    layout, listed as zero3), and `auto` where fsdp > 1 without stages (it runs no pipeline;
    with fsdp 1 no weight is split for the compiler to choose about); meshes of replicas
    only are ddp's. With `contexts`, the meshes with a context axis follow (ZeRO stages only,
    without a stage axis: jddp's ddp and `auto` take no context axis, and context inside
    pipeline stages is not planned), each with the ring and with all_gather attention. With
    `experts` (a mixture of experts' count), the ZeRO stages on the meshes with an expert axis
    of each size > 1 dividing both it and `devices` come last (with `contexts`, those with a
    context axis too)."""
    layouts = [Layout("ddp", data=devices)]
    for mesh in factorizations(devices, tensor_limit, stages):
        if mesh["fsdp"] == 1 and mesh["tensor"] == 1 and mesh["stage"] == 1:
            continue
        for strategy in STAGES if mesh["fsdp"] > 1 else ("zero3",):
            layouts.append(Layout(strategy, **mesh))
        if mesh["fsdp"] > 1 and mesh["stage"] == 1:
            layouts.append(Layout("auto", **mesh))
    if contexts:
        for mesh in factorizations(devices, tensor_limit, contexts=True):
            if mesh["context"] == 1:
                continue
            for strategy in STAGES if mesh["fsdp"] > 1 else ("zero3",):
                for attention in CONTEXT_ATTENTIONS:
                    layouts.append(Layout(strategy, **mesh, context_attention=attention))
    sizes = range(2, devices + 1) if experts else ()
    for expert in (n for n in sizes if experts % n == 0 and devices % n == 0):
        for mesh in factorizations(devices // expert, tensor_limit, stages, contexts):
            gathered = CONTEXT_ATTENTIONS if mesh.get("context", 1) > 1 else ("ring",)
            for strategy in STAGES if mesh["fsdp"] > 1 else ("zero3",):
                for attention in gathered:
                    layouts.append(
                        Layout(strategy, **mesh, expert=expert, context_attention=attention)
                    )
    return layouts
