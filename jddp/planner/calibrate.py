"""Measuring this machine as the `cpu` device profile (`python -m jddp.plan --calibrate`).

    matmul rate     the best of a few 2048^3 float32 matmuls through XLA: the whole machine's
                    rate, which the simulated devices share (`shared_compute`)
    memory          DRAM bandwidth from a large elementwise add into a buffer the process holds
                    (what the optimizer update and a step's non-matmul ops pay)
    intra-host      what an all-reduce, all-gather, reduce-scatter and collective-permute
                    among the in-process simulated devices (XLA:CPU) adds to a step, timed
                    between the calibration GPT's blocks as a step runs them, a few sizes
                    each, over all the devices and over pairs; bandwidth, latency per ring
                    step and overhead per op fitted to the ring formulas of
                    jddp/planner/network.py
    inter-host      the same over 2 processes x 2 devices, gloo between them (started with
                    jddp.runtime.launch on 127.0.0.1): what crosses "hosts" when a job runs as
                    several
                    processes (every collective of such a job, on XLA:CPU)
    matmul shapes   every device at once through matmuls whose smallest dimension is 32 to
                    512: the rate by that dimension, relative to the widest (a tensor split
                    narrows a small model's projections; the planner weights each matmul by it)
    efficiency      a small GPT trained by every simulated device at once, each its own copy
                    with no communication: the model FLOPs over (step time less the memory-bound
                    time the planner predicts: non-matmul ops, optimizer) x the matmul rate;
                    again with the layers stacked and scanned (as pipeline stages run them):
                    the ratio is the profile's `stacked_layers_slowdown`

On a shared machine every number moves with the load: calibrate in the same run as what you
compare against (experiments/bench/planner.py does).
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from jddp.errors import JddpError

SIZES = (2**16, 2**18, 2**20, 2**22)  # bytes per device: a small model's parameters
REPEATS = 5
# Collectives are timed between blocks of the calibration GPT (see `collective_seconds`), as
# many as a step of it has, on its tokens spread over the devices measured.
REPEATS_BETWEEN = 7
# Matmul rates by their smallest dimension d: (rows, wide) @ (wide, d) @ (d, wide) per device.
SHAPE_DIMS, SHAPE_OPERAND = (32, 64, 128, 256, 512), (2048, 512)
GLOO_PROCESSES, GLOO_DEVICES_PER_PROCESS = 2, 2  # devices share the cores, as in a job
# Collectives are timed over groups of all the devices and of this many (neighbours in the
# device order: a process's own pair in the gloo job): two ring lengths separate the latency
# per ring step from the overhead per op.
PAIR = 2
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
CALIBRATION_GPT = dict(num_layers=4, num_heads=8, embed_dim=256, max_seq_len=128)
CALIBRATION_VOCAB, CALIBRATION_BATCH = 1024, 32  # rows over all devices


def _seconds(fn, repeats: int = REPEATS) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after one that compiles and warms up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _median_seconds(fn, repeats: int = REPEATS) -> float:
    return statistics.median(_seconds(fn, repeats))


def memory_bandwidth(megabytes: int = 64) -> float:
    """Bytes/s of `memory_stream`, the best of `REPEATS` passes after a warm-up: a stream's rate
    is its best, a slower repeat measures what else ran (one median read 9 GB/s where the best
    of the same run was 40)."""
    stream, bytes_per_pass = memory_stream(megabytes)
    return bytes_per_pass / min(_seconds(stream))


def memory_stream(megabytes: int = 64):
    """(stream, bytes): `stream()` computes `c = a + b` over float32 arrays of `megabytes`,
    written into the same `c` every pass (3 arrays' traffic; `a + a` reads one, a third less
    than it counts). A fresh output each pass would land, for several passes or, under
    glibc's own settings (a 64 MiB buffer is always mmapped), for every one, on pages fresh
    from the OS, and measure the page faults (16,384 a pass, 0.4-0.9 GB/s here): one
    calibration whose every timed pass faulted stored 1.9 GB/s instead of 37."""
    import jax
    import jax.numpy as jnp

    n = megabytes * 2**20 // 4
    a, b, c = (jax.device_put(jnp.full((n,), v, jnp.float32), jax.devices()[0]) for v in (1, 2, 0))
    # `out` is donated and unread: XLA writes the sum into its buffer (without keep_unused,
    # jit drops the unused argument and nothing is aliased).
    add_into = jax.jit(lambda x, y, out: x + y, donate_argnums=2, keep_unused=True)

    def stream():
        nonlocal c
        c = add_into(a, b, c).block_until_ready()
        return c

    return stream, 3 * n * 4


def collective_seconds(devices, group: int, sizes=SIZES) -> dict[str, dict[int, float]]:
    """{kind: {bytes per device: seconds}}: what one all-reduce, all-gather, reduce-scatter or
    collective-permute over groups of `group` neighbouring `devices` adds to a step (every
    process calls this with the same global devices). Timed as a step runs them
    (`between_blocks`), less the same blocks without a collective, over the number of blocks.
    On XLA:CPU a collective's copies, gloo's sockets and the thread hand-offs run on the cores
    the compute uses, so it costs more in a step than on idle devices (gloo's 64 KB all-reduce
    between 2 processes x 2 devices: 0.4 ms alone, 2-5 ms between blocks), and the planner
    predicts steps. Windows interleaved, medians."""
    import jax

    mesh = group_mesh(devices, group)
    inputs = block_inputs(mesh)  # one set for every program
    programs = {None: between_blocks(mesh, None, group, inputs)}
    for kind in COLLECTIVES:
        for size in sizes:  # elements divisible by the group: the scatter
            programs[kind, size] = between_blocks(mesh, kind, size // 4 // group * group, inputs)
    runs = {
        key: lambda step=step, args=args: jax.block_until_ready(step(*args))
        for key, (step, args) in programs.items()
    }
    seconds = _interleaved_medians(runs)
    blocks_alone = seconds.pop(None)
    out = {kind: {} for kind in COLLECTIVES}
    for (kind, size), median in seconds.items():
        out[kind][size] = max((median - blocks_alone) / CALIBRATION_GPT["num_layers"], 0.0)
    return out


def _collective(kind: str, x, group: int):
    """`kind` over the mesh axis "x" of `group` devices (inside shard_map)."""
    from jax import lax

    if kind == "all-reduce":
        return lax.psum(x, "x")
    if kind == "all-gather":
        return lax.all_gather(x, "x", tiled=True)
    if kind == "reduce-scatter":
        return lax.psum_scatter(x, "x", tiled=True)
    ring = [(i, (i + 1) % group) for i in range(group)]  # a pipeline's send to the next stage
    return lax.ppermute(x, "x", ring)


def group_mesh(devices, group: int):
    """`devices` in groups of `group` neighbours: the mesh axes ("groups", "x")."""
    from jax.sharding import Mesh

    return Mesh(np.asarray(devices).reshape(-1, group), ("groups", "x"))


def block_inputs(mesh) -> tuple:
    """(activations, *kernels) on every device of `mesh`: its share of the calibration GPT's
    tokens and one block's kernels (`_block`)."""
    rows = CALIBRATION_BATCH * CALIBRATION_GPT["max_seq_len"] // mesh.size
    width = CALIBRATION_GPT["embed_dim"]
    return _per_device(mesh, rows, width), *(_per_device(mesh, *s) for s in _block_shapes(width))


def between_blocks(mesh, kind: str | None, elements: int, inputs: tuple):
    """(step, args): `step(*args)` is one step of every device of `mesh` (`group_mesh`)
    running the calibration GPT's blocks (their norms, projections and MLP; attention's
    products left out) on `inputs` (`block_inputs`), with a collective of `kind` over
    `elements` float32 per device after each block (None: none) over the mesh's axis "x". The
    collective's input depends on the block and the next block on its result, as in a step:
    XLA would combine independent ones into one op (its all-reduce combiner merged the 4 into
    one tuple all-reduce, which timed each at a quarter of an op), and a tensor-parallel step's
    activation reductions cannot be combined."""
    import jax
    from jax.sharding import PartitionSpec as P

    group = mesh.shape["x"]

    def run_blocks(v, x, *w):
        v, x, w = v[0], x[0], [k[0] for k in w]
        for _ in range(CALIBRATION_GPT["num_layers"]):
            x = _block(x, *w)
            if kind is not None:
                x = x + _collective(kind, v + x[0, 0], group)[0]
        return x[None]

    every = P(mesh.axis_names)
    step = jax.jit(
        jax.shard_map(run_blocks, mesh=mesh, in_specs=every, out_specs=every, check_vma=False)
    )
    return step, (_per_device(mesh, elements), *inputs)


def _block_shapes(width: int) -> list[tuple[int, int]]:
    """The kernels of one calibration GPT block: qkv, out, the MLP's fc and proj."""
    return [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]


def _block(x, qkv, out, fc, proj):
    """A GPT block's work without attention's products: norm, projections, norm, MLP."""
    import jax

    def norm(y):
        centered = y - y.mean(-1, keepdims=True)
        return centered * jax.lax.rsqrt((centered**2).mean(-1, keepdims=True) + 1e-6)

    x = x + (norm(x) @ qkv)[:, : x.shape[-1]] @ out
    return x + jax.nn.gelu(norm(x) @ fc) @ proj


def _per_device(mesh, *shape):
    """A float32 array of `shape` on each device of `mesh` (stacked along all its axes)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    local = np.full((len(mesh.local_devices), *shape), 0.01, np.float32)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P(mesh.axis_names)), local)


def _interleaved_medians(runs: dict) -> dict:
    """{key: median seconds of `runs[key]()`}: each compiled and warmed up, then timed in
    `REPEATS_BETWEEN` rounds that take every run in turn (the machine's drift hits them all)."""
    times = {key: [] for key in runs}
    for run in runs.values():
        run()
    for _ in range(REPEATS_BETWEEN):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            run()
            times[key].append((time.perf_counter() - start) / 2)
    return {key: statistics.median(t) for key, t in times.items()}


def matmul_shape_rates(devices) -> tuple[tuple[int, float], ...]:
    """((d, rate), ...) for each d of `SHAPE_DIMS`: every device at once runs the forward and
    backward of `(rows, wide) @ (wide, d)`, tanh, `@ (d, wide)` (a layer's projections split
    over tensor); the rate in FLOP/s relative to that at the widest d. Interleaved windows,
    medians."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("x",))
    rows, wide = SHAPE_OPERAND

    def loss(x, a, b):
        return jax.numpy.sum(jax.numpy.tanh(x @ a) @ b)

    def grads(x, a, b):
        return jax.tree.map(lambda g: g[None], jax.grad(loss, (0, 1, 2))(x[0], a[0], b[0]))

    step = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = _per_device(mesh, rows, wide)
    runs = {}
    for d in SHAPE_DIMS:
        a, b = _per_device(mesh, wide, d), _per_device(mesh, d, wide)
        runs[d] = lambda a=a, b=b: jax.block_until_ready(step(x, a, b))
    rates = {d: d / t for d, t in _interleaved_medians(runs).items()}  # FLOPs: linear in d
    return tuple((d, rates[d] / rates[SHAPE_DIMS[-1]]) for d in SHAPE_DIMS)


def fit_link(seconds: dict[int, dict[str, dict[int, float]]]) -> tuple[float, float, float]:
    """(bandwidth bytes/s, latency s per ring step, overhead s per op) fitting the ring
    formulas of jddp/planner/network.py to the times measured over groups of each size
    ({devices in the group: {kind: {bytes per device: seconds}}}), least squares with every
    term non-negative. Absolute error, not relative: in a step a small in-process collective
    adds next to nothing (its copies hide among the other devices' compute on the shared cores),
    and a relative fit would let that noisy near-zero time decide the bandwidth."""
    from scipy.optimize import nnls

    rows, times = [], []
    for n, by_kind in seconds.items():
        for kind, by_size in by_kind.items():
            steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
            for size, t in by_size.items():
                volume = size * n if kind == "all-gather" else size  # the formula's buffer
                if kind == "collective-permute":  # V/B + a + o
                    rows.append([volume, 1, 1])
                else:
                    rows.append([steps / n * volume, steps, 1])
                times.append(t)
    (inverse_bw, latency, overhead), _ = nnls(np.array(rows, float), np.array(times, float))
    return 1 / max(inverse_bw, 1e-15), float(latency), float(overhead)  # 1e-15: beyond measuring


def gpt_efficiency(profile, devices, scan_layers: bool = False) -> tuple[float, float]:
    """(efficiency, measured step seconds) of the calibration GPT with every device busy
    (`scan_layers`: its layers stacked and run as one scan, as pipeline stages run them):
    each of `devices` trains its own copy on its own rows (AdamW), none waits for another, as
    no layout's compute does. Efficiency: the model FLOPs of all of them (each weighted by its
    shape's rate, as the planner weights them) over (step time less the memory-bound time the
    planner predicts for them) x the matmul rate. One device alone
    gets less out of a machine's cores than several at once, so it would mispredict every
    layout that runs them all."""
    run, workload, _ = gpt_copies_step(devices, scan_layers)
    seconds = _median_seconds(run)
    return efficiency_of(seconds, workload, len(devices), profile), seconds


def efficiency_of(
    seconds: float, workload, devices: int, profile, allow_above_one: bool = False
) -> float:
    """The efficiency of a step of `workload` on `devices` devices (each its own copy) that
    took `seconds`: its FLOPs over (the time less its memory-bound part) x the matmul rate.
    Above 1 the matmul rate was measured in a slower spell than the step: refused unless
    `allow_above_one` (the planner benchmark fits windows timed up to half an hour after the
    rate was measured)."""
    from jddp.planner.layouts import Layout
    from jddp.planner.timing import memory_bound_seconds, shape_slowdown

    layout = Layout("ddp", data=devices)
    memory_bound = sum(memory_bound_seconds(workload, layout, profile))
    if memory_bound >= seconds:  # a bandwidth measured far too low (was capped at 1.0 silently)
        raise JddpError(
            f"the calibration measured a step of {seconds * 1e3:.0f} ms, shorter than its "
            f"memory traffic alone at the {profile.memory_bandwidth / 1e9:.1f} GB/s it measured "
            f"({memory_bound * 1e3:.0f} ms): the machine's load changed while calibrating; "
            "run --calibrate again"
        )
    matmul_seconds = seconds - memory_bound
    flops = workload.hardware_flops() * shape_slowdown(workload, layout, profile)
    efficiency = flops / (matmul_seconds * profile.peak_flops)
    # Above 1: a rate measured in a slow spell (once capped at 1.0 silently, which
    # mispredicted every layout 1.4-2x).
    if efficiency > 1 and not allow_above_one:
        raise JddpError(
            f"the calibration GPT's matmuls ran at {flops / matmul_seconds / 1e9:.0f} GFLOP/s, "
            f"faster than the {profile.peak_flops / 1e9:.0f} GFLOP/s measured as this machine's "
            "matmul rate: the machine's load changed while calibrating; run --calibrate again"
        )
    return efficiency


class GptCopies(NamedTuple):
    run: Callable[[], None]  # one step of every copy, finished when it returns
    workload: Any  # the planner's view of the same training
    compiled_text: Callable[[], str]  # the step's compiled HLO (what one device runs)


def gpt_copies_step(devices, scan_layers: bool = False) -> GptCopies:
    """Every device of `devices` training its own copy of the calibration GPT (see
    `gpt_efficiency`)."""
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jddp.core.task import jit_init
    from jddp.losses import token_cross_entropy
    from jddp.models import GPT
    from jddp.planner.workload import model_workload

    n, seq = len(devices), CALIBRATION_GPT["max_seq_len"]
    model = GPT(CALIBRATION_VOCAB, **CALIBRATION_GPT, scan_layers=scan_layers)
    optimizer = optax.adamw(1e-3)
    rows = max(1, CALIBRATION_BATCH // n) * n
    tokens = np.random.default_rng(0).integers(0, CALIBRATION_VOCAB, (rows, seq + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}

    def init():
        params = model.init(jax.random.key(0), batch["inputs"][:1])["params"]
        return params, optimizer.init(params)

    def own_step(params, opt_state, rows):  # one device's copy: no collective anywhere
        def loss(p):
            return token_cross_entropy(model.apply({"params": p}, rows["inputs"]), rows).mean()

        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    mesh = Mesh(np.asarray(devices), ("x",))
    per_device = NamedSharding(mesh, P("x"))
    copies = jit_init(
        lambda: jax.tree.map(lambda x: jax.numpy.stack([x] * n), init()), out_shardings=per_device
    )
    unstacked = jax.shard_map(
        lambda state, rows: jax.tree.map(
            lambda x: x[None], own_step(*jax.tree.map(lambda x: x[0], state), rows)
        ),
        mesh=mesh,
        in_specs=(P("x"), P("x")),
        out_specs=P("x"),
    )
    step = jax.jit(unstacked, donate_argnums=0)
    # Each process places the rows of its own devices: the copies may span a job's processes.
    per_copy = rows // n
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    local = {
        k: np.concatenate([v[i * per_copy : (i + 1) * per_copy] for i in mine])
        for k, v in batch.items()
    }
    placed = {
        k: jax.make_array_from_process_local_data(per_device, v, batch[k].shape)
        for k, v in local.items()
    }
    holder = [copies]

    def run():
        holder[0] = step(holder[0], placed)
        jax.block_until_ready(holder[0])

    def compiled_text() -> str:
        return step.lower(holder[0], placed).compile().as_text()

    workload = model_workload(model, batch["inputs"][:1], rows, optimizer, min_shard_size=1)
    return GptCopies(run, workload, compiled_text)


def _launch_gloo_worker(timeout: int = 300) -> dict:
    command = [
        sys.executable, "-m", "jddp.runtime.launch", f"--nproc={GLOO_PROCESSES}",
        f"--devices_per_proc={GLOO_DEVICES_PER_PROCESS}", "--",
        sys.executable, "-m", "jddp.planner.calibrate", "--worker",
    ]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise JddpError(_gloo_failed(f"no result within {timeout} s")) from None
    for line in result.stdout.splitlines():
        if line.startswith("[0] RESULT "):
            return json.loads(line.removeprefix("[0] RESULT "))
    output = (result.stdout + result.stderr).strip().splitlines()
    last = output[-1].strip() if output else "no output"
    raise JddpError(_gloo_failed(f"exit code {result.returncode}; last line: {last}"))


def _gloo_failed(reason: str) -> str:
    return (
        f"--calibrate: the gloo measurement between {GLOO_PROCESSES} processes failed ({reason}); "
        "nothing was stored. Check that the processes can use ports on 127.0.0.1, then rerun"
    )


def calibrate(path: str | None = None) -> tuple[str, dict]:
    """Measures this machine and stores it as the `cpu` profile; (path, measurements). Needs
    the process's simulated devices (jax_num_cpu_devices) set before the first JAX call."""
    import jax

    from jddp.observe.device_peak import measured_matmul_rate
    from jddp.planner.devices import DeviceProfile, check_profile_path, save_cpu_profile

    devices = jax.devices()
    if len(devices) <= PAIR or len(devices) % PAIR:  # two group sizes, pairs tiling the devices
        raise JddpError(
            f"--calibrate times collectives over all the devices and over pairs: it needs an even "
            f"number above {PAIR} of simulated devices, not {len(devices)}; set "
            "jax_num_cpu_devices=8 before JAX starts (`python -m jddp.plan --calibrate` does)"
        )
    path = check_profile_path(path)  # before minutes of measuring
    rate = measured_matmul_rate(devices[0])
    bandwidth = memory_bandwidth()
    shape_rates = matmul_shape_rates(devices)
    intra_times = {n: collective_seconds(devices, n) for n in (len(devices), PAIR)}
    inter_times = {
        int(n): {kind: {int(s): t for s, t in by_size.items()} for kind, by_size in v.items()}
        for n, v in _launch_gloo_worker().items()
    }
    # Again, minutes later: a shared machine's slow spell can span a whole measurement (one
    # calibration read 131 GFLOP/s and 23 GB/s where its neighbours read 385-438 and 42-43).
    rate = max(rate, measured_matmul_rate(devices[0]))
    bandwidth = max(bandwidth, memory_bandwidth())
    rings = ("all-reduce", "all-gather", "reduce-scatter")  # the common link: ring collectives

    def fitted(times, kinds):
        return fit_link({n: {k: by_kind[k] for k in kinds} for n, by_kind in times.items()})

    bw_intra, lat_intra, over_intra = fitted(intra_times, rings)
    bw_inter, lat_inter, over_inter = fitted(inter_times, rings)
    per_kind = []  # DeviceProfile.per_kind's order: the two links, then their overheads
    for kind in COLLECTIVES:
        bw_i, lat_i, over_i = fitted(intra_times, [kind])
        bw_x, lat_x, over_x = fitted(inter_times, [kind])
        per_kind.append((kind, bw_i, lat_i, bw_x, lat_x, over_i, over_x))
    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    profile = DeviceProfile(
        "cpu",
        peak_flops=rate,
        memory=float(pages),
        memory_bandwidth=bandwidth,
        bw_intra=bw_intra,
        bw_inter=bw_inter,
        latency_intra=lat_intra,
        latency_inter=lat_inter,
        overhead_intra=over_intra,
        overhead_inter=over_inter,
        efficiency=1.0,  # measured below, with the rest of the profile in place
        devices_per_host=len(devices),
        overlap=False,  # XLA:CPU runs a device's collectives in line with its compute
        combined_kinds=("all-reduce",),  # seen in its HLO: one tuple all-reduce, many gathers
        per_kind=tuple(per_kind),
        matmul_shape_rates=shape_rates,
        shared_compute=True,
        every_group_crosses_hosts=True,  # gloo carries every collective of a multi-process job
        sources=(
            f"measured by `python -m jddp.plan --calibrate` on {time.strftime('%Y-%m-%d %H:%M')}"
            f", load average {os.getloadavg()[0]:.1f}: {len(devices)} simulated devices, "
            f"gloo across {GLOO_PROCESSES} processes x {GLOO_DEVICES_PER_PROCESS} devices; "
            "collectives timed between the calibration GPT's blocks, over all the devices and "
            "over pairs",
        ),
    )
    efficiency, gpt_seconds = gpt_efficiency(profile, devices)
    scanned, scanned_seconds = gpt_efficiency(profile, devices, scan_layers=True)
    profile = dataclasses.replace(
        profile, efficiency=efficiency, stacked_layers_slowdown=efficiency / scanned
    )
    measurements = {
        "matmul_flops": rate,
        "memory_bandwidth": bandwidth,
        "intra_seconds": intra_times,
        "inter_seconds": inter_times,
        "gpt_step_seconds": gpt_seconds,
        "gpt_scanned_step_seconds": scanned_seconds,
        "load_average": os.getloadavg()[0],
    }
    return save_cpu_profile(profile, measurements, path), measurements


def _worker() -> None:
    from jddp.runtime import processes as runtime

    runtime.initialize()
    import jax

    devices = jax.devices()  # process by process: a pair is one process's own devices
    seconds = {n: collective_seconds(devices, n) for n in (len(devices), PAIR)}
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(seconds), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
