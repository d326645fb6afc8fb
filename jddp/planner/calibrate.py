"""Measuring this machine as the `cpu` device profile (`python -m jddp.plan --calibrate`).

    matmul rate     the best of a few 2048^3 float32 matmuls through XLA: the whole machine's
                    rate, which the simulated devices share (`shared_compute`)
    memory          DRAM bandwidth from a large elementwise add (what the optimizer update pays)
    intra-host      all-reduce, all-gather, reduce-scatter and collective-permute among the
                    in-process simulated
                    devices (XLA:CPU), a few sizes each; latency and bandwidth fitted to the
                    ring formulas of jddp/planner/network.py
    inter-host      the same between 2 processes over gloo (started with jddp.launch on
                    127.0.0.1): what crosses "hosts" when a job runs as several processes
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

import numpy as np

SIZES = (2**16, 2**18, 2**20, 2**22)  # bytes per device: a small model's parameters
REPEATS = 5
CALIBRATION_GPT = dict(num_layers=4, num_heads=8, embed_dim=256, max_seq_len=128)
CALIBRATION_VOCAB, CALIBRATION_BATCH = 1024, 32  # rows over all devices


def _median_seconds(fn, repeats: int = REPEATS) -> float:
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(megabytes: int = 64) -> float:
    """Bytes/s of `c = a + b` over float32 arrays of `megabytes` (3 arrays' traffic)."""
    import jax
    import jax.numpy as jnp

    n = megabytes * 2**20 // 4
    a = jax.device_put(jnp.ones((n,), jnp.float32), jax.devices()[0])
    add = jax.jit(lambda x, y: x + y)
    seconds = _median_seconds(lambda: add(a, a).block_until_ready())
    return 3 * n * 4 / seconds


def collective_seconds(devices, sizes=SIZES) -> dict[str, dict[int, float]]:
    """{kind: {bytes per device: median seconds}} for all-reduce, all-gather and reduce-scatter
    over `devices` (every process calls this with the same global devices)."""
    import jax
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("x",))
    n = len(devices)
    ops = {
        "all-reduce": lambda x: lax.psum(x, "x"),
        "all-gather": lambda x: lax.all_gather(x, "x", tiled=True),
        "reduce-scatter": lambda x: lax.psum_scatter(x, "x", tiled=True),
        # a pipeline's send to the next stage
        "collective-permute": lambda x: lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)]),
    }
    out = {}
    for kind, op in ops.items():
        step = jax.jit(
            jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        )
        out[kind] = {}
        for size in sizes:
            elements = size // 4 // n * n  # divisible for the scatter
            local = np.ones((elements,), np.float32)
            sharding = NamedSharding(mesh, P("x"))
            x = jax.make_array_from_process_local_data(
                sharding, np.concatenate([local] * (len(mesh.local_devices)))
            )
            out[kind][size] = _median_seconds(lambda x=x, step=step: step(x).block_until_ready())
    return out


def fit_link(seconds: dict[str, dict[int, float]], n: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) fitting the ring formulas of jddp/planner/network.py
    to the measured times, least squares on relative error, both terms kept non-negative."""
    rows = []
    for kind, by_size in seconds.items():
        steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
        for size, t in by_size.items():
            volume = size * n if kind == "all-gather" else size  # the buffer the formula takes
            if kind == "collective-permute":  # V/B + a
                rows.append([volume / t, 1 / t])
            else:
                rows.append([steps / n * volume / t, steps / t])
    rows = np.array(rows)
    ones = np.ones(len(rows))
    (inverse_bw, latency), *_ = np.linalg.lstsq(rows, ones, rcond=None)
    if latency < 0:  # bandwidth alone
        inverse_bw, latency = float(rows[:, 0] @ ones / (rows[:, 0] @ rows[:, 0])), 0.0
    if inverse_bw <= 0:  # latency alone: bandwidth beyond measuring
        inverse_bw, latency = 1e-15, float(rows[:, 1] @ ones / (rows[:, 1] @ rows[:, 1]))
    return 1 / inverse_bw, latency


def gpt_efficiency(profile, devices, scan_layers: bool = False) -> tuple[float, float]:
    """(efficiency, measured step seconds) of the calibration GPT with every device busy
    (`scan_layers`: its layers stacked and run as one scan, as pipeline stages run them):
    each of `devices` trains its own copy on its own rows (AdamW), none waits for another, as
    no layout's compute does. Efficiency: the model FLOPs of all of them over (step time less
    the memory-bound time the planner predicts for them) x the matmul rate. One device alone
    gets less out of a machine's cores than several at once, so it would mispredict every
    layout that runs them all."""
    run, workload = gpt_copies_step(devices, scan_layers)
    seconds = _median_seconds(run)
    return efficiency_of(seconds, workload, len(devices), profile), seconds


def efficiency_of(seconds: float, workload, devices: int, profile) -> float:
    """The efficiency of a step of `workload` on `devices` devices (each its own copy) that
    took `seconds`: its FLOPs over (the time less its memory-bound part) x the matmul rate."""
    from jddp.planner.layouts import Layout
    from jddp.planner.timing import memory_bound_seconds

    elementwise, update = memory_bound_seconds(workload, Layout("ddp", data=devices), profile)
    matmul_seconds = max(seconds - elementwise - update, 1e-9)
    return min(1.0, workload.hardware_flops() / (matmul_seconds * profile.peak_flops))


def gpt_copies_step(devices, scan_layers: bool = False):
    """(run, workload): `run()` is one step of every device training its own copy of the
    calibration GPT (see `gpt_efficiency`), finished when it returns; `workload` is the
    planner's view of the same training."""
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jddp.core import jit_init
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
    placed = jax.device_put(batch, per_device)
    holder = [copies]

    def run():
        holder[0] = step(holder[0], placed)
        jax.block_until_ready(holder[0])

    return run, model_workload(model, batch["inputs"][:1], rows, optimizer, min_shard_size=1)


def _launch_gloo_worker(timeout: int = 300) -> dict:
    command = [
        sys.executable, "-m", "jddp.launch", "--nproc=2", "--devices_per_proc=1", "--",
        sys.executable, "-m", "jddp.planner.calibrate", "--worker",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    for line in result.stdout.splitlines():
        if line.startswith("[0] RESULT "):
            return json.loads(line.removeprefix("[0] RESULT "))
    raise RuntimeError(f"gloo calibration failed:\n{(result.stdout + result.stderr)[-2000:]}")


def calibrate(path: str | None = None) -> tuple[str, dict]:
    """Measures this machine and stores it as the `cpu` profile; (path, measurements). Needs
    the process's simulated devices (jax_num_cpu_devices) set before the first JAX call."""
    import jax

    from jddp.device_peak import measured_matmul_rate
    from jddp.planner.devices import DeviceProfile, check_profile_path, save_cpu_profile

    path = check_profile_path(path)  # before minutes of measuring
    devices = jax.devices()
    rate = measured_matmul_rate(devices[0])
    bandwidth = memory_bandwidth()
    intra_times = collective_seconds(devices)
    inter_times = {k: {int(s): t for s, t in v.items()} for k, v in _launch_gloo_worker().items()}
    rings = ("all-reduce", "all-gather", "reduce-scatter")  # the common link: ring collectives
    bw_intra, lat_intra = fit_link({k: intra_times[k] for k in rings}, len(devices))
    bw_inter, lat_inter = fit_link({k: inter_times[k] for k in rings}, 2)
    per_kind = tuple(
        (kind, *fit_link({kind: intra_times[kind]}, len(devices)),
         *fit_link({kind: inter_times[kind]}, 2))
        for kind in intra_times
    )  # fmt: skip
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
        efficiency=1.0,  # measured below, with the rest of the profile in place
        devices_per_host=len(devices),
        overlap=False,  # XLA:CPU runs a device's collectives in line with its compute
        combined_kinds=("all-reduce",),  # seen in its HLO: one tuple all-reduce, many gathers
        per_kind=per_kind,
        shared_compute=True,
        every_group_crosses_hosts=True,  # gloo carries every collective of a multi-process job
        sources=(
            f"measured by `python -m jddp.plan --calibrate` on {time.strftime('%Y-%m-%d %H:%M')}"
            f", load average {os.getloadavg()[0]:.1f}: {len(devices)} simulated devices, "
            "gloo across 2 processes",
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
    from jddp import runtime

    runtime.initialize()
    import jax

    seconds = collective_seconds(jax.devices())
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(seconds), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
