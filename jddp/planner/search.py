"""Every layout of a workload on N devices, predicted and ranked: what `python -m jddp.plan`
prints. Shapes only: nothing is compiled (jddp/planner/compiled.py adds exact peaks where the
step compiles on this machine)."""

import dataclasses

from jddp.errors import ConfigError
from jddp.planner.devices import DeviceProfile
from jddp.planner.layouts import Layout, candidates
from jddp.planner.memory_model import activation_bytes, gathered_bytes, state_bytes
from jddp.planner.shards import all_shards, check_rules
from jddp.planner.stages import check_stages, microbatches
from jddp.planner.timing import predict
from jddp.planner.workload import Workload


def why_not(workload: Workload, layout: Layout) -> str | None:
    """Why `workload` cannot run under `layout` (None if it can)."""
    t = workload.transformer
    parts = layout.batch_slices * workload.grad_accum_steps
    if workload.global_batch % parts:
        return f"global batch {workload.global_batch} does not split into {parts}"
    for axis, refusal in workload.refused_axes:
        if layout.sizes[axis] > 1:
            return refusal
    if reason := check_stages(workload, layout):
        return reason
    if layout.tensor > 1:
        if t is None:
            return "tensor parallelism is planned for transformers only"
        for name, size in (("heads", t.heads), ("mlp", t.mlp_dim), ("vocabulary", t.vocab)):
            if size % layout.tensor:
                return f"{name} {size} do not split over tensor={layout.tensor}"
        if layout.sequence_parallel and t.seq_len % layout.tensor:
            return f"sequences of {t.seq_len} do not split over tensor={layout.tensor}"
        if layout.sequence_parallel and workload.frozen_params:  # jddp/run/config.py
            return "LoRA does not run under sequence parallelism"
    if reason := _why_not_context(workload, layout):
        return reason
    try:
        all_shards(workload, layout)
    except ConfigError as e:
        return str(e)
    return None


def _why_not_context(workload: Workload, layout: Layout) -> str | None:
    """Why the workload's sequences cannot be split over `layout`'s context axis."""
    c, t = layout.context, workload.transformer
    if c == 1:
        return None
    if t is None:
        return "context parallelism splits a transformer's attention; this model has none"
    if layout.strategy not in ("zero1", "zero2", "zero3"):
        return f"{layout.strategy} takes no context axis (zero1, zero2 or zero3 do)"
    if t.seq_len % (2 * c):
        return f"sequences of {t.seq_len} do not cut into 2 x context = {2 * c} equal chunks"
    if t.fused_attention:
        return "context attention does not run the fused (cuDNN) attention"
    return None


def layouts_for(
    workload: Workload, devices: int, devices_per_host: int, stages: bool, contexts: bool = False
):
    """(layouts that can run, {layout name: why not} for those that cannot); tensor-parallel
    meshes with and without sequence parallelism (`auto` without: not measured); with
    `contexts`, a transformer's meshes with a context axis too (ring and all_gather); for a
    mixture of experts, meshes with an expert axis too."""
    valid, rejected = [], {}
    t = workload.transformer
    contexts = contexts and t is not None
    experts = t.moe.num_experts if t is not None and t.moe else 0
    for layout in candidates(devices, devices_per_host, stages, contexts, experts):
        variants = [layout]
        if layout.tensor > 1 and layout.strategy != "auto":
            variants.append(dataclasses.replace(layout, sequence_parallel=True))
        for variant in variants:
            reason = why_not(workload, variant)
            if reason:
                rejected[variant.name] = reason
            else:
                valid.append(variant)
    return valid, rejected


def plan_row(
    workload: Workload,
    layout: Layout,
    profile: DeviceProfile,
    devices_per_host: int,
    exposed_axes: tuple[str, ...] = (),
) -> dict:
    """One layout's predicted memory and time (the `--json` row)."""
    workload = workload.on(layout)
    state = state_bytes(workload, layout)
    activations = activation_bytes(workload, layout)
    total = state.total + (activations or 0) + gathered_bytes(workload, layout)
    p = predict(workload, layout, profile, devices_per_host, exposed_axes)
    return {
        "strategy": layout.strategy,
        "mesh": {a: layout.sizes[a] for a in ("data", "fsdp", "tensor", "stage")}
        | ({"context": layout.context} if layout.context > 1 else {})
        | ({"expert": layout.expert} if layout.expert > 1 else {}),
        "sequence_parallel": layout.sequence_parallel,
        "context_attention": layout.context_attention if layout.context > 1 else None,
        "pipeline_microbatches": microbatches(workload, layout) if layout.stage > 1 else 0,
        "layout": layout.name,
        "bytes_per_device": int(total),
        "state_bytes": {
            "params": state.params,
            "grads": state.grads,
            "optimizer": state.optimizer,
        },
        "activation_bytes": activations,
        "memory_source": "analytic",
        "fits": total <= profile.memory,
        "predicted_step_s": p.step_s,
        "compute_s": p.compute_s,
        "optimizer_s": p.optimizer_s,
        "exposed_comm_s": dict(sorted(p.exposed_s.items())),
        "comm_s": dict(sorted(p.comm_s.items())),
        "bubble_s": p.bubble_s,
        "sync_s": p.sync_s,
        "bytes_across_hosts": p.bytes_across_hosts,
        "predicted_tokens_per_s": p.tokens_per_s,
        "predicted_mfu": p.mfu,
    }


def rank(rows: list[dict]) -> list[dict]:
    """Plans that fit first, fastest first; then the rest, smallest first."""
    return sorted(
        rows,
        key=lambda r: (
            not r["fits"],
            r["predicted_step_s"] if r["fits"] else r["bytes_per_device"],
        ),
    )


def plan(
    workload: Workload,
    devices: int,
    profile: DeviceProfile,
    devices_per_host: int,
    stages: bool = True,
    contexts: bool = True,
) -> tuple[list[dict], dict[str, str]]:
    """(ranked rows, {layout: why it cannot run}); a ConfigError if no layout can run, or if
    the partition rules are wrong whatever the layout (`shards.check_rules`). `contexts`: a
    transformer's layouts with a context axis are planned too (ranked with the rest: chosen
    where nothing else fits, or where they are predicted faster)."""
    check_rules(workload)
    layouts, rejected = layouts_for(workload, devices, devices_per_host, stages, contexts)
    if not layouts:
        reasons = sorted(set(rejected.values()))[:3]
        raise ConfigError(
            f"{devices} devices do not factor for {workload.name}: no data x fsdp x tensor x "
            f"stage mesh can run it ({'; '.join(reasons)}); choose a device count that "
            f"divides the global batch ({workload.global_batch}) or change global_batch_size"
        )
    rows = [plan_row(workload, layout, profile, devices_per_host) for layout in layouts]
    return rank(rows), rejected
