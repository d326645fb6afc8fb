"""The `cpu` profile from the measurements of measure.py: link bandwidth, latency and overhead
fitted to the ring formulas of jddp/planner/network.py, the efficiency of the calibration GPT,
and the gloo measurement across 2 processes (started with jddp.runtime.launch).
"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

from experiments.calibrate.measure import (
    COLLECTIVES,
    GLOO_DEVICES_PER_PROCESS,
    GLOO_PROCESSES,
    PAIR,
    _median_seconds,
    collective_seconds,
    gpt_copies_step,
    matmul_shape_rates,
    memory_bandwidth,
)
from jddp.errors import JddpError

# The checkout holding experiments/: the gloo workers import this package from it.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    if memory_bound >= seconds:  # a bandwidth measured far too low: refuse rather than cap
        raise JddpError(
            f"the calibration measured a step of {seconds * 1e3:.0f} ms, shorter than its "
            f"memory traffic alone at the {profile.memory_bandwidth / 1e9:.1f} GB/s it measured "
            f"({memory_bound * 1e3:.0f} ms): the machine's load changed while calibrating; "
            "run `python -m experiments.calibrate` again"
        )
    matmul_seconds = seconds - memory_bound
    flops = workload.hardware_flops() * shape_slowdown(workload, layout, profile)
    efficiency = flops / (matmul_seconds * profile.peak_flops)
    # Above 1: the matmul rate was measured in a slow spell. Refused, not capped at 1.0: a
    # capped efficiency mispredicts every layout 1.4-2x.
    if efficiency > 1 and not allow_above_one:
        raise JddpError(
            f"the calibration GPT's matmuls ran at {flops / matmul_seconds / 1e9:.0f} GFLOP/s, "
            f"faster than the {profile.peak_flops / 1e9:.0f} GFLOP/s measured as this machine's "
            "matmul rate: the machine's load changed while calibrating; run `python -m "
            "experiments.calibrate` again"
        )
    return efficiency


def _launch_gloo_worker(timeout: int = 300) -> dict:
    command = [
        sys.executable, "-m", "jddp.runtime.launch", f"--nproc={GLOO_PROCESSES}",
        f"--devices_per_proc={GLOO_DEVICES_PER_PROCESS}", "--",
        sys.executable, "-m", "experiments.calibrate", "--worker",
    ]  # fmt: skip
    # The workers import experiments/ from this checkout, wherever the command was started.
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = os.environ | {"PYTHONPATH": path}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
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
        f"the calibration's gloo measurement between {GLOO_PROCESSES} processes failed ({reason}); "
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
            "the calibration times collectives over all the devices and over pairs: it needs an "
            f"even number above {PAIR} of simulated devices, not {len(devices)}; set "
            "jax_num_cpu_devices=8 before JAX starts (`python -m experiments.calibrate` does)"
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
    # Again, minutes later, keeping the better: a shared machine's slow spell can span a whole
    # measurement (a third of the matmul rate and half the bandwidth).
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
            f"measured by `python -m experiments.calibrate` on {time.strftime('%Y-%m-%d %H:%M')}"
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
