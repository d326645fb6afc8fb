"""The planner's time model on hand-computed cases, the device presets, and the published runs
it reproduces. Shapes only: nothing here compiles or runs a step."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jddp.errors import ConfigError
from jddp.planner import devices, network, published, timing
from jddp.planner import memory_model as memory
from jddp.planner import stages as pipeline
from jddp.planner.layouts import Layout, candidates, factorizations
from jddp.planner.workload import Transformer, Workload, transformer_params

GB = 1e9


# --------------------------------------------------------------------- collective formulas
def test_ring_formulas():
    link = network.Link(bandwidth=1e9, latency=1e-6)
    # 4 devices, 1 GB: all-reduce 2 x 3/4 x 1 s + 6 steps; gather and scatter half that
    assert network.ring_time("all-reduce", 1e9, 4, link) == pytest.approx(1.5 + 6e-6)
    assert network.ring_time("all-gather", 1e9, 4, link) == pytest.approx(0.75 + 3e-6)
    assert network.ring_time("reduce-scatter", 1e9, 4, link) == pytest.approx(0.75 + 3e-6)
    assert network.ring_time("collective-permute", 1e9, 2, link) == pytest.approx(1 + 1e-6)
    assert network.ring_time("all-reduce", 1e9, 1, link) == 0
    # an overhead per op (XLA:CPU's thread hand-offs) is paid once, whatever the ring's length
    busy = network.Link(bandwidth=1e9, latency=1e-6, overhead=1e-3)
    assert network.ring_time("all-reduce", 1e9, 4, busy) == pytest.approx(1.5 + 6e-6 + 1e-3)
    assert network.ring_time("reduce-scatter", 1e9, 2, busy) == pytest.approx(0.5 + 1e-6 + 1e-3)
    assert network.ring_time("collective-permute", 1e9, 2, busy) == pytest.approx(1 + 1e-6 + 1e-3)
    assert network.ring_time("all-gather", 1e9, 1, busy) == 0


def test_axis_links_follow_the_device_order_and_hosts():
    intra, inter = network.Link(100e9, 0.0), network.Link(10e9, 0.0)
    layout = Layout("zero3", data=2, fsdp=4)  # fsdp fastest: devices 0-3 are one fsdp group
    # fsdp inside a host of 4: 3/4 x 1 GB at 100 GB/s
    t = network.collective_time("all-gather", 1e9, layout, ("fsdp",), intra, inter, 4)
    assert t == pytest.approx(0.75 / 100)
    # data pairs devices 0 and 4, on two hosts: 2 x 1/2 x 1 GB at 10 GB/s
    t = network.collective_time("all-reduce", 1e9, layout, ("data",), intra, inter, 4)
    assert t == pytest.approx(1 / 10)
    # data x fsdp over 2 hosts of 4: reduce-scatter and all-gather inside (3/4 GB each at
    # 100 GB/s), the quarter each device holds all-reduced across the 2 hosts at 10 GB/s
    t = network.collective_time("all-reduce", 1e9, layout, ("data", "fsdp"), intra, inter, 4)
    assert t == pytest.approx(2 * 0.75 / 100 + 2 * 0.5 * 0.25 / 10)
    # a reduce-scatter's result is a shard: its input is 4 x the result
    t = network.collective_time("reduce-scatter", 0.25e9, layout, ("fsdp",), intra, inter, 4)
    assert t == pytest.approx(0.75 / 100)


def test_bytes_across_hosts_share_the_machines_network_by_hand():
    """A data-parallel all-reduce of 1 GB over 4 hosts of 8 (data:32): reduce-scatter and
    all-gather inside each host, then 8 rings side by side across the hosts, each carrying an
    eighth, 2 x 3/4 x 1/8 GB per device; the 8 devices together send what one ring of the whole
    gigabyte would at the machine's bandwidth, so each runs at its eighth of the machine's
    NICs (the H100 preset: 8 x 400 Gb/s per DGX, 50 GB/s per GPU)."""
    h100 = devices.PRESETS["h100"]
    assert h100.bw_inter == pytest.approx(8 * 400e9 / 8 / 8)
    assert devices.PRESETS["tpu-v5e"].bw_inter == pytest.approx(2 * 100e9 / 8 / 8)
    layout = Layout("ddp", data=32)
    rings = network.op_phases("all-reduce", 1e9, layout, ("data",), 8)
    assert network.bytes_across_hosts(rings) == pytest.approx(2 * 3 / 4 * 1e9 / 8)
    machine = network.Link(8 * h100.bw_inter, h100.latency_inter)
    one_ring = network.ring_time("all-reduce", 1e9, 4, machine)
    intra, inter = h100.links("all-reduce")
    inside = 2 * (7 / 8 * 1e9 / intra.bandwidth + 7 * intra.latency)
    t = network.collective_time("all-reduce", 1e9, layout, ("data",), intra, inter, 8)
    assert t == pytest.approx(inside + one_ring)
    # one device per host (a data axis across slices): the flat ring, all of it across
    flat = network.op_phases("all-reduce", 1e9, Layout("zero3", data=4, fsdp=8), ("data",), 8)
    assert network.bytes_across_hosts(flat) == pytest.approx(2 * 3 / 4 * 1e9)
    assert (
        network.bytes_across_hosts(network.op_phases("all-reduce", 1e9, layout, ("data",), 32)) == 0
    )
    # a step's: ddp's 8 MiB of gradients over 4 hosts of 8, the same eighths; none in one host
    p = timing.predict(mlp_workload(), layout, PROFILE, 8)
    assert p.bytes_across_hosts == pytest.approx(2 * 3 / 4 * 8 * 2**20 / 8)
    assert timing.predict(mlp_workload(), layout, PROFILE, 32).bytes_across_hosts == 0


def test_a_step_waits_for_the_slowest_host():
    """slowest_of(P) is the expected maximum of P standard normals (against a sampled one); a
    job over P hosts waits step x spread x slowest_of(P) more than inside one host, and
    nothing with one host or no spread."""
    rng = np.random.default_rng(0)
    for p in (2, 4, 32, 256):
        sampled = rng.standard_normal((20000, p)).max(axis=1).mean()
        assert network.slowest_of(p) == pytest.approx(sampled, rel=0.05), p
    assert network.slowest_of(1) == 0
    w, layout = mlp_workload(), Layout("ddp", data=8)
    spread = dataclasses.replace(PROFILE, step_spread=0.05)
    alone = timing.predict(w, layout, PROFILE, 2)
    p = timing.predict(w, layout, spread, 2)  # 4 hosts of 2
    assert p.sync_s == pytest.approx(alone.step_s * 0.05 * network.slowest_of(4))
    assert p.step_s == pytest.approx(alone.step_s + p.sync_s)
    assert timing.predict(w, layout, spread, 8).sync_s == 0  # one host
    with pytest.raises(ConfigError, match="step_spread"):
        dataclasses.replace(PROFILE, step_spread=1.5).check()


def test_pipeline_bubble():
    t = Transformer(8, 64, 4, 256, 128, 16)
    w = Workload("w", transformer_params(t), 64, 1.0, transformer=t, microbatches=8)
    assert pipeline.bubble_fraction(w, Layout("zero3", fsdp=2, stage=4)) == pytest.approx(3 / 11)
    interleaved = dataclasses.replace(w, virtual_stages=2)
    assert pipeline.bubble_fraction(interleaved, Layout("zero3", fsdp=2, stage=4)) == (
        pytest.approx(3 / 19)
    )
    assert pipeline.bubble_fraction(w, Layout("zero3", fsdp=8)) == 0


def test_pipeline_sends_by_hand():
    """4 stages of 2 layers, 8 micro-batches of 4 rows x 16 tokens x width 64 in float32
    (16,384 bytes): jddp's lockstep engine sends forward and back at every one of its
    3 (M + S - 1) = 33 ticks (the backward in two ticks), Megatron only the 2 M real sends."""
    t = Transformer(8, 64, 4, 256, 128, 16)
    w = Workload("w", transformer_params(t), 64, 1.0, transformer=t, microbatches=8)
    layout = Layout("zero3", fsdp=2, stage=4)
    sends, reduce = pipeline.stage_collectives(w, layout)
    assert (sends.kind, sends.nbytes, sends.count) == ("collective-permute", 4 * 16 * 64 * 4, 66)
    # the parameters outside the stack (embedding 128 x 64, positions 16 x 64, final norm)
    assert (reduce.kind, reduce.nbytes) == ("all-reduce", 4 * (128 * 64 + 16 * 64 + 2 * 64))
    megatron = dataclasses.replace(w, lockstep_pipeline=False)
    (sends,) = pipeline.stage_collectives(megatron, layout)
    assert sends.count == 16


def test_activation_bytes_by_hand():
    """4 stages of 2 layers, 8 micro-batches of 64 / (2 x 8) = 4 rows x 16 tokens x width 64,
    float32 (Korthikanti's 16-bit bytes x 2): 1F1B keeps 4 micro-batches in flight, everything
    of them (a pipeline's remat=none). Per layer
    s b h (34 + 5 a s / h) = 4,096 x 39 x 2 bytes; with remat only the layers' inputs
    (4,096 x 4 bytes) per micro-batch in flight, and one layer's activations while it is
    recomputed, once. Plus the float32 logits and their gradient."""
    t = Transformer(8, 64, 4, 256, 128, 16)
    w = Workload("w", transformer_params(t), 64, 1.0, transformer=t, microbatches=8)
    w = dataclasses.replace(w, pipeline_remat="none")
    layout = Layout("zero3", fsdp=2, stage=4)
    per_layer, logits = 4096 * 39 * 2, 2 * 4 * 16 * 128 * 4
    assert memory.activation_bytes(w, layout) == 2 * per_layer * 4 + logits
    remat = dataclasses.replace(w, recompute=1.0)
    assert memory.activation_bytes(remat, layout) == 2 * 4096 * 4 * 4 + per_layer + logits


def test_a_pipelines_remat_sets_what_its_stages_keep():
    """The layout above with jddp's pipeline (`none` the test above): `dots` keeps s b h (20 +
    2 a s / h) x 2 bytes a layer (a s / h = 1), and one layer's whole activations while it is
    recomputed; `full` what the model's remat keeps, and its forward is computed twice."""
    t = Transformer(8, 64, 4, 256, 128, 16)
    w = Workload("w", transformer_params(t), 64, t.train_flops(64), transformer=t, microbatches=8)
    layout = Layout("zero3", fsdp=2, stage=4)
    per_layer, logits = 4096 * 39 * 2, 2 * 4 * 16 * 128 * 4
    dots = dataclasses.replace(w, pipeline_remat="dots")
    assert memory.activation_bytes(dots, layout) == 2 * 4096 * 22 * 2 * 4 + per_layer + logits
    full = dataclasses.replace(w, pipeline_remat="full")
    assert memory.activation_bytes(full.on(layout), layout) == 2 * 4096 * 4 * 4 + per_layer + logits
    assert full.on(layout).hardware_flops() > w.hardware_flops()
    assert full.on(Layout("zero3", fsdp=8)) == full  # no stages: nothing recomputed


# ------------------------------------------------------------------------ the step's time
PROFILE = devices.DeviceProfile(
    "test", peak_flops=100e12, memory=80 * GB, memory_bandwidth=1e12, bw_intra=100e9,
    bw_inter=10e9, latency_intra=0.0, latency_inter=0.0, efficiency=0.5, devices_per_host=8,
)  # fmt: skip


def mlp_workload(kernels=2, size=1024):
    """`kernels` float32 size x size kernels (no transformer), 1e15 FLOPs per step."""
    kernel = jax.ShapeDtypeStruct((size, size), np.float32)
    return Workload("mlp", {f"k{i}": kernel for i in range(kernels)}, 64, 1e15)


def test_ddp_step_by_hand():
    """8 devices on one host, 1e15 FLOPs: 1e15 / 8 / (100e12 x 0.5) = 2.5 ms of compute; the
    8 MiB of gradients all-reduced in one combined op (2 x 7/8 x 8 MiB at 100 GB/s), which
    waits for the whole backward pass; Adam's update reads and writes 8 MiB of parameters and
    16 MiB of moments and reads the gradients, at 1 TB/s."""
    w, layout = mlp_workload(), Layout("ddp", data=8)
    p = timing.predict(w, layout, PROFILE, 8)
    mib8 = 8 * 2**20
    assert p.compute_s == pytest.approx(1e15 / 8 / 50e12)
    assert p.comm_s == {"data": pytest.approx(2 * 7 / 8 * mib8 / 100e9)}
    assert p.exposed_s == p.comm_s  # one op: nothing to overlap it with
    assert p.optimizer_s == pytest.approx((2 * (mib8 + 2 * mib8) + mib8) / 1e12)
    assert p.step_s == pytest.approx(p.compute_s + p.comm_s["data"] + p.optimizer_s)
    assert p.mfu == pytest.approx(1e15 / (p.step_s * 8 * 100e12))


def test_gradient_buckets_overlap_the_backward_pass():
    """64 MiB of gradients in two 32 MiB buckets (XLA's combiner): the first hides under the
    backward pass (2/3 of 2.5 ms), the last does not; without async collectives (the CPU)
    both are exposed."""
    w, layout = mlp_workload(kernels=4, size=2048), Layout("ddp", data=8)
    p = timing.predict(w, layout, PROFILE, 8)
    bucket = 2 * 7 / 8 * 32 * 2**20 / 100e9
    assert p.comm_s == {"data": pytest.approx(2 * bucket)}
    assert p.exposed_s == {"data": pytest.approx(bucket)}
    serial = timing.predict(w, layout, dataclasses.replace(PROFILE, overlap=False), 8)
    assert serial.exposed_s == {"data": pytest.approx(2 * bucket)}


def test_zero3_across_hosts_by_hand():
    """fsdp:8 over 2 hosts of 4: each kernel (4 MiB) gathered (hierarchically: 1/4 across
    hosts, then inside), its gradient reduce-scattered; all exposed without overlap."""
    w, layout = mlp_workload(), Layout("zero3", fsdp=8)
    profile = dataclasses.replace(PROFILE, overlap=False)
    p = timing.predict(w, layout, profile, 4)
    mib8 = 8 * 2**20  # both kernels, combined into one op per kind
    inside = 3 / 4 * mib8 / 100e9
    across = 1 / 2 * mib8 / 4 / 10e9
    assert p.comm_s == {"fsdp": pytest.approx(2 * (inside + across))}
    assert p.exposed_s == p.comm_s


def test_xla_cpu_rings_every_group_of_a_multiprocess_job_over_gloo():
    """data:2 x fsdp:2 over 2 hosts of 2 (both kernels, 8 MiB, one combined op per kind): the
    fsdp pairs sit inside a host, but on XLA:CPU (every_group_crosses_hosts) a job of several
    processes rings them over the inter-host link too: the gather (1/2 x 8 MiB) and the
    gradients' reduce-scatter (1/2 x 8 MiB) at 10 GB/s instead of 100."""
    w, layout = mlp_workload(), Layout("zero3", data=2, fsdp=2)
    cpu_like = dataclasses.replace(PROFILE, overlap=False, every_group_crosses_hosts=True)
    mib8, shard_all_reduce = 8 * 2**20, 2 * 1 / 2 * 4 * 2**20 / 10e9
    p = timing.predict(w, layout, cpu_like, 2)
    assert p.comm_s == {
        "fsdp": pytest.approx(2 * 1 / 2 * mib8 / 10e9),
        "data": pytest.approx(shard_all_reduce),
    }
    other = dataclasses.replace(cpu_like, every_group_crosses_hosts=False)
    assert timing.predict(w, layout, other, 2).comm_s["fsdp"] == pytest.approx(
        2 * 1 / 2 * mib8 / 100e9
    )
    # one process: its own devices' link, as before
    assert timing.predict(w, layout, cpu_like, 4).comm_s["fsdp"] == pytest.approx(
        2 * 1 / 2 * mib8 / 100e9
    )


def test_tensor_parallel_time_by_hand():
    """A transformer's activation all-reduces sit on the critical path: (4 layers x 2 + 2
    per pass... ) 4 L + 2 of B x T x width, never hidden."""
    t = Transformer(2, 256, 4, 1024, 512, 128)
    w = Workload(
        "gpt", transformer_params(t), 8, t.train_flops(8), transformer=t, min_shard_size=1,
        rules_for=published._megatron_rules,
    )  # fmt: skip
    p = timing.predict(w, Layout("zero3", tensor=8), PROFILE, 8)
    activation = 8 * 128 * 256 * 4  # rows x tokens x width x float32
    per_op = 2 * 7 / 8 * activation / 100e9
    assert p.exposed_s["tensor"] >= (4 * 2 + 2) * per_op * 0.999


def test_non_matmul_traffic_by_hand():
    """A block's memory-bound ops: per token, norms 2 x 2h, residual adds 2 x 3h, the GELU
    2 x mlp and softmax 2 x heads x seq (split over tensor; norms and adds too with sequence
    parallelism), times 4 bytes, times forward + backward (3); dropout adds a pass each. The
    attention matmuls' scores (Q K^T writes them, the product with V reads them: 2 x heads x
    seq) are memory traffic too on a profile without a measured shape curve; flash attention
    has none."""
    t = Transformer(2, 256, 4, 1024, 512, 128)
    whole, split = 10 * 256, 2 * 1024 + 2 * 4 * 128
    assert t.elementwise_elements() == whole + split
    assert t.elementwise_elements(tensor=4) == whole + split / 4
    assert t.elementwise_elements(tensor=4, sequence_parallel=True) == (whole + split) / 4
    dropped = dataclasses.replace(t, dropout=True, attention_dropout=True)
    assert dropped.elementwise_elements() == whole + 4 * 256 + 2 * 1024 + 4 * 4 * 128
    w = Workload("gpt", transformer_params(t), 8, 1e12, transformer=t)
    tokens = 8 * 128 / 2  # over data:2
    expected = tokens * 2 * (whole + split) * 4 * 3
    assert w.elementwise_bytes(1, False, batch_slices=2, stages=1) == expected
    scores = tokens * 2 * (2 * 4 * 128) * 4 * 3
    assert w.score_bytes(1, batch_slices=2, stages=1) == scores
    p = timing.predict(w, Layout("zero3", data=2), PROFILE, 8)
    assert p.compute_s == pytest.approx(1e12 / 2 / 50e12 + (expected + scores) / 1e12)
    fused = dataclasses.replace(w, transformer=dataclasses.replace(t, fused_attention=True))
    assert fused.score_bytes(4, batch_slices=1, stages=1) == 0
    measured = dataclasses.replace(PROFILE, matmul_shape_rates=((32, 0.5), (128, 1.0)))
    assert timing.memory_bound_seconds(w, Layout("zero3", data=2), measured)[0] == pytest.approx(
        expected / 1e12
    )


# ------------------------------------------------------------------------------- layouts
def test_a_failed_gloo_measurement_is_one_line(monkeypatch):
    """The calibration's 2-process measurement: a worker that dies (a killed peer, a port in use)
    or hangs is a JddpError of one line (the CLI prints it and exits 2), not a traceback with
    the workers' output."""
    import subprocess

    from experiments.calibrate import profile
    from jddp.errors import JddpError

    def died(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "[0] starting\n", "Traceback ...\nboom\n")

    def hung(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    for run, reason in ((died, "exit code 1; last line: boom"), (hung, "no result within 5 s")):
        monkeypatch.setattr(profile.subprocess, "run", run)
        with pytest.raises(JddpError) as error:
            profile._launch_gloo_worker(timeout=5)
        assert reason in str(error.value) and "nothing was stored" in str(error.value)
        assert "\n" not in str(error.value)


def test_calibrate_refuses_device_counts_it_cannot_pair_before_writing(monkeypatch, tmp_path):
    """The calibration times collectives over all the devices and over pairs: an odd count, or
    no more devices than a pair, is one JddpError before anything is measured or written."""
    import jax

    from experiments.calibrate import profile
    from jddp.errors import JddpError

    every = jax.devices()
    for count in (1, 2, 3):
        monkeypatch.setattr(jax, "devices", lambda count=count: every[:count])
        with pytest.raises(JddpError, match=f"not {count}; set jax_num_cpu_devices=8"):
            profile.calibrate(str(tmp_path / "profile" / "cpu.json"))
    assert not (tmp_path / "profile").exists()


def test_calibration_times_one_collective_per_block_each_waited_for():
    """The calibration times each collective between the calibration GPT's blocks: the compiled
    program runs one op of the kind per block over the elements asked, none combined with
    another (XLA's all-reduce combiner merged 4 independent ones into one tuple op, and the
    calibration timed each at a quarter of its cost), in the group asked."""
    import re

    import jax

    from experiments.calibrate import measure

    blocks = measure.CALIBRATION_GPT["num_layers"]
    elements, group = 2**14, 4
    result = {  # the shape of each op's result, per device
        "all-reduce": elements,
        "all-gather": elements * group,
        "reduce-scatter": elements // group,
        "collective-permute": elements,
    }
    groups = "replica_groups={{0,1,2,3},{4,5,6,7}}"
    ring = "source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}"

    mesh = measure.group_mesh(jax.devices(), group)
    inputs = measure.block_inputs(mesh)

    def compiled(kind):
        step, args = measure.between_blocks(mesh, kind, elements, inputs)
        return step.lower(*args).compile().as_text()

    for kind in measure.COLLECTIVES:
        ops = re.findall(rf"= (\S+) {kind}(?:-start)?\((.*)", compiled(kind))
        assert [shape for shape, _ in ops] == [f"f32[{result[kind]}]{{0}}"] * blocks, kind
        for _, rest in ops:
            assert (ring if kind == "collective-permute" else groups) in rest, rest
    assert not re.search("|".join(measure.COLLECTIVES), compiled(None))


# Passes of the calibration's memory stream after one warm-up, in a fresh process: the fresh
# pages each took from the OS, and the sum it computed.
STREAM_FAULTS = """
import json, resource
import jddp
from jddp.runtime.host_memory import minor_faults
from experiments.calibrate.measure import memory_stream
stream, nbytes = memory_stream(64)
stream()
before = minor_faults()
for _ in range(5):
    result = stream()
pages = nbytes // 3 // resource.getpagesize()  # of one array
print(json.dumps({"faults": (minor_faults() - before) / 5, "pages": pages,
                  "sums": sorted({float(v) for v in result[::4096]})}))
"""


def test_memory_stream_runs_on_memory_the_process_holds():
    """The calibration times the memory bandwidth with `c = a + b` written into the same buffer
    every pass: a pass takes no pages fresh from the OS, with jddp's malloc settings or with
    glibc's own, under which a fresh 64 MiB output is mmapped every pass (16,384 faults, and a
    calibration of 1.9 GB/s where the memory streams 37). It computes the sum."""
    from tests.helpers import run_in_fresh_process

    for env in ({}, {"JDDP_MALLOC_TUNING": "0"}):
        passes = run_in_fresh_process(STREAM_FAULTS, **env)
        assert passes["faults"] < passes["pages"] / 16, env
        assert passes["sums"] == [3.0], env


def test_efficiency_refuses_a_step_shorter_than_its_memory_traffic():
    """A calibration whose memory bandwidth was measured far too low (1.9 GB/s where the memory
    streams 37: every pass on fresh pages), or whose matmul rate was (131 GFLOP/s where the
    machine runs 385-438), says so in one line instead of storing an efficiency capped at 1.0
    that mispredicts every layout 1.4-2.9x."""
    from experiments.calibrate.profile import efficiency_of
    from jddp.errors import JddpError
    from tests.helpers import assert_one_line

    t = Transformer(2, 256, 8, 1024, 1024, 128)
    w = Workload("gpt", transformer_params(t), 8, 1e12, transformer=t, min_shard_size=1)
    layout = Layout("ddp", data=8)
    memory_bound = sum(timing.memory_bound_seconds(w, layout, PROFILE))
    flops = w.hardware_flops()
    step = memory_bound + flops / (0.5 * PROFILE.peak_flops)
    assert efficiency_of(step, w, 8, PROFILE) == pytest.approx(0.5)
    with pytest.raises(JddpError) as error:
        efficiency_of(memory_bound * 0.9, w, 8, PROFILE)
    assert_one_line(error, "shorter than its memory traffic", "experiments.calibrate` again")
    # A matmul rate measured in a slow spell: the step's matmuls ran faster than the "peak".
    with pytest.raises(JddpError) as error:
        efficiency_of(memory_bound + flops / (1.1 * PROFILE.peak_flops), w, 8, PROFILE)
    assert_one_line(error, "faster than the", "experiments.calibrate` again")


def test_the_benchmark_takes_a_faster_matmul_rate_than_the_calibration_measured():
    """The planner benchmark fits each layout's efficiency to the calibration GPT's windows
    beside it, up to half an hour after the matmul rate was measured; where those matmuls ran
    faster (run AK: 106 GFLOP/s against 103, refused at its end), their rate is the machine's:
    efficiency 1, and rate x efficiency is what the windows say (the prediction's only use of
    either)."""
    from experiments.bench import planner as bench
    from experiments.calibrate.profile import efficiency_of

    t = Transformer(2, 256, 8, 1024, 1024, 128)
    w = Workload("gpt", transformer_params(t), 8, 1e12, transformer=t, min_shard_size=1)
    layout = Layout("ddp", data=8)
    memory_bound = sum(timing.memory_bound_seconds(w, layout, PROFILE))
    matmuls = w.hardware_flops() * timing.shape_slowdown(w, layout, PROFILE)
    for speed in (0.6, 1.25):  # the GPT's matmuls at this fraction of the measured rate
        step = memory_bound + matmuls / (speed * PROFILE.peak_flops)
        assert efficiency_of(step, w, 8, PROFILE, allow_above_one=True) == pytest.approx(speed)
        fitted = bench.calibrated(
            PROFILE, {bench.CALIBRATION_FLAT: w}, {bench.CALIBRATION_FLAT: step}, 8
        )
        assert fitted.efficiency == pytest.approx(min(speed, 1.0))
        assert fitted.peak_flops * fitted.efficiency == pytest.approx(speed * PROFILE.peak_flops)
        fitted.check()  # a profile the planner accepts


def test_link_fit_recovers_the_ring_formulas():
    """The calibration fits a link's bandwidth, latency per ring step and overhead per op to
    times measured over groups of 4 and 2 devices: times made from the ring formulas give them
    back; a near-zero time for a small collective (what a small in-process one adds between
    matmuls) barely moves the fit (absolute, not relative, error); without an overhead the fit
    finds none."""
    from experiments.calibrate.measure import COLLECTIVES
    from experiments.calibrate.profile import fit_link

    sizes = (2**16, 2**20, 2**22)

    def measured(link):
        return {
            n: {
                kind: {
                    s: network.ring_time(kind, s * n if kind == "all-gather" else s, n, link)
                    for s in sizes
                }
                for kind in COLLECTIVES
            }
            for n in (4, 2)
        }

    times = measured(network.Link(2e9, 1e-3, 3e-3))
    assert fit_link(times) == pytest.approx((2e9, 1e-3, 3e-3))
    times[4]["reduce-scatter"][2**16] = 0.0
    bandwidth, latency, overhead = fit_link(times)
    assert bandwidth == pytest.approx(2e9, rel=0.2)  # it gives 1.73e9
    assert latency + overhead == pytest.approx(4e-3, rel=0.2)
    bandwidth, latency, overhead = fit_link(measured(network.Link(2e9, 1e-3)))
    assert (bandwidth, latency) == pytest.approx((2e9, 1e-3)) and overhead == pytest.approx(
        0, abs=1e-9
    )


def test_narrow_matmuls_by_hand():
    """A measured shape curve slows each matmul by the rate of its smallest dimension (log2
    interpolation, ends held); tensor:8 narrows this model's projections to 32-128 columns.
    Without a curve (the accelerator presets) nothing changes."""
    curve = dataclasses.replace(PROFILE, matmul_shape_rates=((32, 0.25), (128, 0.5), (512, 1.0)))
    assert [curve.shape_rate(d) for d in (16, 32, 64, 128, 256, 512, 4096)] == pytest.approx(
        [0.25, 0.25, 0.375, 0.5, 0.75, 1.0, 1.0]
    )
    assert PROFILE.shape_rate(32) == 1.0
    t = Transformer(2, 256, 8, 1024, 1024, 128)  # head_dim 32
    assert t.matmul_dims(8) == (
        (2 * 256 * 96, 96), (2 * 32 * 256, 32), (2 * 2 * 256 * 128, 128),
        (2 * 2 * 32 * 128, 32), (256 * 128, 128),
    )  # fmt: skip
    w = Workload("gpt", transformer_params(t), 8, 1e12, transformer=t, min_shard_size=1)
    weights = [(m, curve.shape_rate(d)) for m, d in t.matmul_dims(8)]
    slowdown = sum(m / r for m, r in weights) / sum(m for m, _ in weights)
    layout = Layout("zero3", tensor=8)
    assert timing.shape_slowdown(w, layout, curve) == pytest.approx(slowdown)
    assert timing.shape_slowdown(w, layout, PROFILE) == 1.0
    flat, narrow = timing.predict(w, layout, PROFILE, 8), timing.predict(w, layout, curve, 8)
    flat_traffic, _ = timing.memory_bound_seconds(w, layout, PROFILE)
    narrow_traffic, _ = timing.memory_bound_seconds(w, layout, curve)  # scores in the curve
    assert narrow.compute_s - narrow_traffic == pytest.approx(
        (flat.compute_s - flat_traffic) * slowdown
    )
    assert timing.shape_slowdown(mlp_workload(), Layout("ddp", data=8), curve) == 1.0


def test_factorizations_and_candidates():
    meshes = factorizations(8, tensor_limit=4)
    assert {(m["data"], m["fsdp"], m["tensor"]) for m in meshes} == {
        (1, 8, 1), (2, 4, 1), (4, 2, 1), (8, 1, 1), (1, 4, 2), (2, 2, 2), (4, 1, 2),
        (1, 2, 4), (2, 1, 4),
    }  # fmt: skip
    names = [layout.name for layout in candidates(8, 4)]
    assert names[0] == "ddp batch:8" and names[-1] == "zero3 data:2,tensor:4"
    assert names.count("zero2 data:2,fsdp:2,tensor:2") == 1  # stages only where fsdp > 1
    assert "zero1 data:4,tensor:2" not in names
    assert len([m for m in factorizations(1024, 8, stages=True)]) > 100


# ------------------------------------------------------------------------------- devices
@pytest.mark.parametrize("name", sorted(devices.PRESETS))
def test_presets_load_with_sources(name):
    profile = devices.get_profile(name)
    profile.check()
    assert profile.sources and all(isinstance(s, str) and s for s in profile.sources)
    assert 0 < profile.efficiency <= 1 and profile.devices_per_host >= 1


def test_unknown_device_and_missing_cpu_profile_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown --device='v100'.*choose one of"):
        devices.get_profile("v100")
    with pytest.raises(ConfigError, match="run `python -m experiments.calibrate` first"):
        devices.get_profile("cpu", str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match="bw_intra=0"):
        dataclasses.replace(PROFILE, bw_intra=0).check()
    bad_curves = (
        ((64, 0.5), (32, 1.0)), ((32, "fast"),), ((32,),), ((0, 0.5),), ((32, float("nan")),),
        ((32, 0.5), (float("inf"), 1.0)),
    )  # fmt: skip
    for curve in bad_curves:
        with pytest.raises(ConfigError, match="matmul_shape_rates=.*experiments.calibrate"):
            dataclasses.replace(PROFILE, matmul_shape_rates=curve).check()
    for field in ("latency_intra", "latency_inter", "overhead_intra", "overhead_inter"):
        for bad in (-1e-3, float("nan"), float("inf")):
            with pytest.raises(
                ConfigError, match=f"{field}=.*latencies and overheads must be >= 0"
            ):
                dataclasses.replace(PROFILE, **{field: bad}).check()
    for field in ("peak_flops", "memory", "memory_bandwidth", "bw_intra", "bw_inter"):
        with pytest.raises(ConfigError, match=f"{field}=nan must be positive"):
            dataclasses.replace(PROFILE, **{field: float("nan")}).check()
        with pytest.raises(ConfigError, match=f"{field}=inf must be finite"):
            dataclasses.replace(PROFILE, **{field: float("inf")}).check()
    bad_kinds = (
        ("all-gather", 1e9, 0.0, 1e9, 0.0, 1e-3),  # truncated: an overhead missing
        ("all-gather", 1e9, 0.0, 1e9, 0.0, -1e-3, 0.0),  # a negative overhead
        ("all-gather", 0.0, 0.0, 1e9, 0.0),  # no bandwidth
        ("all-gather", 1e9, float("nan"), 1e9, 0.0),
        (7, 1e9, 0.0, 1e9, 0.0),  # no kind
        (),
    )
    for entry in bad_kinds:
        with pytest.raises(ConfigError, match="per_kind entry .*experiments.calibrate"):
            dataclasses.replace(PROFILE, per_kind=(entry,)).check()


def test_cpu_profile_round_trips(tmp_path):
    path = str(tmp_path / "cpu.json")
    profile = dataclasses.replace(
        PROFILE,
        name="cpu",
        per_kind=(("all-gather", 1, 2, 3, 4, 5, 6),),
        overhead_intra=0.5,
        matmul_shape_rates=((32, 0.5), (512, 1.0)),
        partitioner_reduce_scatter=False,  # XLA:CPU's, set on every load
    )
    devices.save_cpu_profile(profile, {"matmul_flops": 1.0}, path)
    assert devices.get_profile("cpu", path) == profile
    assert devices.get_profile("cpu", path).links("all-gather") == (
        network.Link(1, 2, 5),
        network.Link(3, 4, 6),
    )
    assert devices.get_profile("cpu", path).links("all-reduce")[0].overhead == 0.5
    assert json.load(open(path))["measurements"] == {"matmul_flops": 1.0}
    # a profile stored before every_group_crosses_hosts existed: XLA:CPU's behaviour, not a
    # measurement, so it loads as true
    record = json.load(open(path))
    del record["every_group_crosses_hosts"]
    json.dump(record, open(path, "w"))
    assert devices.get_profile("cpu", path).every_group_crosses_hosts
    # one stored before the overheads per op existed: 5 numbers per kind, no overhead fields
    record["per_kind"] = [["all-gather", 1, 2, 3, 4]]
    del record["overhead_intra"], record["overhead_inter"]
    json.dump(record, open(path, "w"))
    old = devices.get_profile("cpu", path)
    assert old.links("all-gather") == (network.Link(1, 2), network.Link(3, 4))
    assert old.links("all-reduce")[0].overhead == 0
    # a hand-edited entry is refused when the profile is read, before anything plans with it
    record["per_kind"] = [["all-gather", 1, 2, 3, 4, 5]]
    json.dump(record, open(path, "w"))
    with pytest.raises(ConfigError, match="per_kind entry"):
        devices.get_profile("cpu", path)


def test_an_unwritable_profile_path_is_refused_before_measuring_and_nothing_changes(tmp_path):
    """The calibration checks where it will write before it measures (calibrate() calls
    `check_profile_path` first): a file in the way, or a folder at the path, is one
    ConfigError naming the path; a profile already there is left as it was."""
    (tmp_path / "afile").write_text("keep")
    for path, reason in ((tmp_path / "afile" / "cpu.json", "is a file"), (tmp_path, "folder")):
        with pytest.raises(ConfigError, match=f"{path}.*{reason}.*JDDP_CPU_PROFILE"):
            devices.check_profile_path(str(path))
        with pytest.raises(ConfigError, match=reason):
            devices.save_cpu_profile(PROFILE, {}, str(path))
    assert (tmp_path / "afile").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# ----------------------------------------------------------------------------- published
RUNS = {run.name: run for run in published.RUNS}
# Within 15% of the published figure, one efficiency per device type; three parallelism mixes:
# tensor + pipeline + data (Megatron >= 39B), tensor + data (<= 18B), fsdp + data across slices.
# Not here: PaLM 540B, predicted +15.6% (docs/planner.md "Published runs" says why).
VALIDATED = [
    run.name for run in published.RUNS if not run.calibration and not run.name.startswith("PaLM")
]


@pytest.mark.parametrize("name", VALIDATED)
def test_published_runs_are_predicted_within_15_percent(name):
    run = RUNS[name]
    assert not run.calibration
    predicted = published.predicted_utilization(run)["predicted_mfu"]
    assert predicted == pytest.approx(run.published, rel=0.15)


def test_preset_figures_are_their_calibration_runs():
    """Each efficiency in the presets is what its one calibration run gives; the TPUs' step
    spread what MaxText 22B on 8 slices gives."""
    calibrations = {(run.device, run.calibrates): run for run in published.RUNS if run.calibration}
    assert sorted(calibrations) == [
        ("a100-80gb", "efficiency"),
        ("tpu-v4", "efficiency"),
        ("tpu-v4", "step_spread"),
        ("tpu-v5e", "efficiency"),
    ]
    for (device, figure), run in calibrations.items():
        solved = published.solve_calibration(run)
        assert getattr(devices.PRESETS[device], figure) == pytest.approx(solved, rel=0.01), device
    assert {p.step_spread for name, p in devices.PRESETS.items() if name.startswith("tpu")} == {
        devices.PRESETS["tpu-v4"].step_spread
    }


def test_each_series_falls_as_published():
    """Every series (MaxText's slices on TPU v4 and v5e: one model on more slices; Megatron-LM's
    weak scaling on A100s: the model grown with the GPUs) is predicted to move from its first
    point to its last by its published drop, within a third: the MaxText series fall (none is
    flat: the issue this guards against), Megatron's rises; the rule itself by hand."""
    points = [
        {
            "name": run.name,
            "published_mfu": run.published,
            "predicted_mfu": published.predicted_utilization(run)["predicted_mfu"],
        }
        for run in published.RUNS
    ]
    trends = {s["name"]: s for s in published.series(points)}
    assert sorted(trends) == [
        "MaxText 16B on v5e-256 slices",
        "MaxText 22B on v4-128 slices",
        "Megatron-LM Table 1 (weak scaling)",
    ]
    for name, s in trends.items():
        assert s["within_rule"], name
        assert s["devices"] == sorted(s["devices"]), name
        falls = name.startswith("MaxText")
        assert (s["predicted_drop"] > 0.02) if falls else (s["predicted_drop"] < -0.02), name
    v5e = trends["MaxText 16B on v5e-256 slices"]
    assert [round(x, 4) for x in v5e["published"]] == [
        0.611,
        0.5937,
        0.5914,
        0.5827,
        0.5656,
        0.5465,
    ]
    megatron = trends["Megatron-LM Table 1 (weak scaling)"]
    assert megatron["devices"] == [32, 64, 128, 256, 512, 1024, 1536, 1920, 2520, 3072]
    assert megatron["published_drop"] == pytest.approx(-0.08)  # 44% -> 52%: a rise
    assert published.within_trend_rule(0.06, 0.041) and not published.within_trend_rule(0.06, 0.039)
    assert not published.within_trend_rule(0.06, 0.081) and published.within_trend_rule(
        -0.03, -0.02
    )


def test_interleaved_pipeline_sends_and_never_moves_layers():
    """4 stages x 2 groups of 2 layers (V = 2), 8 micro-batches: the timetable runs
    3 (V M + S - 1) = 57 ticks (the backward in two), each sending both ways; the interleaved
    bubble is 3 / 19; each stage holds the groups it runs, so nothing else crosses the stages
    but the replicated parameters' gradients."""
    t = Transformer(16, 64, 4, 256, 128, 16)
    w = Workload("w", transformer_params(t), 64, 1.0, transformer=t, microbatches=8)
    w = dataclasses.replace(w, virtual_stages=2, pipeline_schedule="gpipe")
    layout = Layout("zero1", stage=4)
    sends, *rest = pipeline.stage_collectives(w, layout)
    assert (sends.kind, sends.count) == ("collective-permute", 2 * 57)
    assert pipeline.bubble_fraction(w, layout) == pytest.approx(3 / 19)
    assert [(c.kind, c.what) for c in rest] == [("all-reduce", "stage grads")]
