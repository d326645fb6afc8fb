"""Device profiles: what a step's time depends on, per device type, each number with its source.

`efficiency` is the one constant per device type that is not on a datasheet: the fraction of
the peak a dense transformer step's FLOPs reach when nothing waits on communication. It is set
once per device type from one measurement named in `sources` (a microbenchmark, or one
published run listed as the calibration row of `python -m jddp.plan --published`) and used for
every prediction on that hardware; `tests/test_planner.py` checks that the numbers
here are what those calibration runs give.

The `cpu` profile is this machine, measured by `python -m experiments.calibrate` (in a jddp
checkout: the measuring programs and their scipy fit are not part of the library) and kept in
the user's cache directory (see `profile_path`): a measurement of one machine under one load
is not a fact to commit to the repository, and every checkout on the machine shares it.
"""

import dataclasses
import json
import math
import os

import numpy as np

from jddp.errors import ConfigError
from jddp.planner.network import Link
from jddp.runtime import atomic_write

# What measures this machine as the `cpu` profile: a program of the repository's experiments/,
# run from a checkout (pip's jddp carries neither it nor its scipy).
CALIBRATE = "python -m experiments.calibrate"

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: float  # dense bfloat16 FLOP/s (the MFU denominator; float32 on cpu)
    memory: float  # bytes of device memory
    memory_bandwidth: float  # bytes/s (HBM, or DRAM on cpu)
    bw_intra: float  # bytes/s per device and direction, inside a host (NVLink, ICI)
    bw_inter: float  # bytes/s per device and direction, across hosts (InfiniBand, DCN)
    latency_intra: float  # seconds per ring step
    latency_inter: float
    efficiency: float  # see the module docstring
    devices_per_host: int  # a host's devices: what shares the fast link (a TPU slice's chips)
    overlap: bool = True  # collectives can run while compute runs (async collectives)
    float32_peak_flops: float = 0.0  # 0: as bfloat16 (TPUs run float32 matmuls as bf16 passes)
    shared_compute: bool = False  # simulated devices: `peak_flops` is the whole machine's
    # A step of layers stacked and run as one scan (what pipeline stages run) over the same
    # step with the layers one by one; 1 where the compiler makes them equal. Measured on cpu.
    stacked_layers_slowdown: float = 1.0
    # Collectives XLA combines across parameters (XLA:CPU combines all-reduces only).
    combined_kinds: tuple[str, ...] = ("all-reduce", "all-gather", "reduce-scatter")
    # A job of several processes rings every collective over the inter-host link, even one
    # among a single process's devices: XLA:CPU sends all collectives through gloo once
    # jax.distributed has started (a 64 KB all-gather between one process's 2 devices: 3.7 ms
    # in a 2-process job, 0.18 ms in a 1-process one).
    every_group_crosses_hosts: bool = False
    # The compiler turns a sum it partitions and then slices into a reduce-scatter (what
    # `auto` leaves to it: jddp/planner/auto.py). XLA:CPU has no such pass: an all-reduce of
    # the whole buffer and a slice (seen in its HLO), twice the bytes.
    partitioner_reduce_scatter: bool = True
    # Seconds per collective op, whatever its group's size (network.Link.overhead; measured
    # profiles only: XLA:CPU's thread hand-offs).
    overhead_intra: float = 0.0
    overhead_inter: float = 0.0
    # Measured profiles: (kind, intra bw, intra latency, inter bw, inter latency, intra
    # overhead, inter overhead) where a kind departs from the common link (XLA:CPU's all-gather
    # is far slower per byte than its all-reduce: one fitted link per kind). An entry of 5
    # numbers has no per-op overheads (0).
    per_kind: tuple[tuple, ...] = ()
    # Measured profiles: a matmul's rate by its smallest dimension, relative to a wide one's
    # ((dimension, relative rate), ...; empty: every shape at the full rate). On XLA:CPU a
    # 128-wide operand runs at ~3/4 of the rate, a 32-wide one at ~0.4 (measured by
    # experiments.calibrate): what a tensor split does to a small model's projections. The
    # accelerator presets stay flat (no datasheet gives the curve).
    matmul_shape_rates: tuple[tuple[int, float], ...] = ()
    # The relative standard deviation of one host's step time where the hosts meet over the
    # inter-host network (jddp/planner/timing.py "slowest"): a step waits for the slowest of
    # them. No datasheet gives it: solved once per system from one published multi-host run
    # (`sources`); 0 where none is published (the GPUs; this machine's simulated hosts).
    step_spread: float = 0.0
    sources: tuple[str, ...] = ()

    def links(self, kind: str) -> tuple[Link, Link]:
        """(intra-host link, inter-host link) for a collective of `kind`."""
        for name, bw_intra, lat_intra, bw_inter, lat_inter, *overheads in self.per_kind:
            if name == kind:
                over_intra, over_inter = overheads or (0.0, 0.0)
                return (
                    Link(bw_intra, lat_intra, over_intra),
                    Link(bw_inter, lat_inter, over_inter),
                )
        return (
            Link(self.bw_intra, self.latency_intra, self.overhead_intra),
            Link(self.bw_inter, self.latency_inter, self.overhead_inter),
        )

    def shape_rate(self, dimension: float) -> float:
        """The rate of a matmul whose smallest dimension is `dimension`, relative to a wide
        one's: interpolated in log2(dimension) between the measured points, the ends held."""
        if not self.matmul_shape_rates:
            return 1.0
        dims, rates = zip(*self.matmul_shape_rates, strict=True)
        return float(np.interp(math.log2(dimension), [math.log2(d) for d in dims], rates))

    def peak_for(self, compute_bytes: int) -> float:
        """Peak FLOP/s for bfloat16 (2) or float32 (4) matmuls."""
        if compute_bytes == 4 and self.float32_peak_flops:
            return self.float32_peak_flops
        return self.peak_flops

    def check(self) -> None:
        """A ConfigError naming the first number that cannot describe a device."""
        for field in ("peak_flops", "memory", "memory_bandwidth", "bw_intra", "bw_inter"):
            value = getattr(self, field)
            if not (_finite(value) and value > 0):
                need = "finite" if value == math.inf else "positive"
                raise ConfigError(
                    f"device {self.name!r}: {field}={value} must be {need}; "
                    f"pass --{_FLAG.get(field, field)}=..."
                )
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"device {self.name!r}: efficiency={self.efficiency} not in (0, 1]")
        if not (_finite(self.step_spread) and 0 <= self.step_spread < 1):
            raise ConfigError(
                f"device {self.name!r}: step_spread={self.step_spread} must be in [0, 1)"
            )
        for field in ("latency_intra", "latency_inter", "overhead_intra", "overhead_inter"):
            value = getattr(self, field)
            if not (_finite(value) and value >= 0):  # NaN compares false: it would plan NaN
                raise ConfigError(
                    f"device {self.name!r}: {field}={value}: latencies and overheads must be >= 0 "
                    "and finite"
                )
        points = self.matmul_shape_rates
        numbers = all(len(p) == 2 and all(_finite(v) and v > 0 for v in p) for p in points)
        if not numbers or any(a[0] >= b[0] for a, b in zip(points, points[1:], strict=False)):
            raise ConfigError(
                f"device {self.name!r}: matmul_shape_rates={points} must be (dimension, rate) "
                f"pairs of positive finite numbers, dimensions increasing; run `{CALIBRATE}` again"
            )
        for entry in self.per_kind:  # (kind, bw, latency, bw, latency[, overhead, overhead])
            numbers = entry[1:]
            if (
                len(entry) not in (5, 7)
                or not isinstance(entry[0], str)
                or not all(_finite(v) and v >= 0 for v in numbers)
                or min(numbers[0], numbers[2]) <= 0
            ):
                raise ConfigError(
                    f"device {self.name!r}: per_kind entry {entry} must be (kind, intra bandwidth, "
                    "intra latency, inter bandwidth, inter latency[, intra overhead, inter "
                    f"overhead]), bandwidths positive, the rest finite and >= 0; run `{CALIBRATE}` "
                    "again"
                )


def _finite(value) -> bool:
    """A real number, not a bool, a string, NaN or an infinity."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


_FLAG = {"memory": "device_memory", "peak_flops": "peak_flops"}

# ------------------------------------------------------------------------------ sources
_NCCL_LATENCY = (
    "ring-step latencies: NCCL src/graph/tuning.cc hwLat, Ring/Simple: NVLink 3.4 us, network "
    "9.6 us"
)
_MAMF = (
    "matmul efficiency (MAMF, bf16): github.com/stas00/ml-engineering "
    "compute/accelerator/README.md: A100 SXM 86.9%, H100 SXM 80.3% ('H200 is the same'), "
    "B200 77.6%"
)
_GPU_EFFICIENCY = (
    "efficiency: A100 solved from the calibration run (Megatron-LM 310B, Narayanan et al. 2021 "
    "Table 1); other GPUs the same software on their matmul units: A100's x MAMF(GPU) / "
    "MAMF(A100)"
)
_SCALING_BOOK = (
    "TPU HBM and ICI: Austin et al., 'How to Scale Your Model' (jax-ml.github.io/"
    "scaling-book), Part 2 tables: ICI bidirectional per link v4 9e10, v5p 2e11, v5e 1e11 B/s; "
    "~1 us per ICI hop"
)
_STEP_SPREAD = (
    "step_spread: solved from the calibration run MaxText 22B on 8x v4-128 (MaxText "
    "configs/v4/README.md: 53.2% MFU against 56.7% on one slice); every TPU, the same "
    "software and data-center network"
)
A100_MAMF, H100_MAMF, B200_MAMF = 0.869, 0.803, 0.776
A100_EFFICIENCY = 0.648  # solved from Megatron-LM 310B (a calibration run of published.py)
TPU_STEP_SPREAD = 0.0457  # solved from MaxText 22B on 8x v4-128 (a calibration run)


def _dcn_share(host_bandwidth: float, devices_per_machine: int) -> float:
    """A device's share of its machine's data-center network bandwidth (bytes/s per direction):
    every device of a machine runs its own ring across machines at the same time (SPMD), so
    each gets 1 / `devices_per_machine` of the machine's NICs."""
    return host_bandwidth / devices_per_machine


def _gpu(name, peak, memory, hbm, nvlink, dcn_per_host, efficiency, *sources) -> DeviceProfile:
    """An NVIDIA GPU in a DGX-style host of 8: NVLink inside, the host's NICs across hosts."""
    return DeviceProfile(
        name,
        peak_flops=peak,
        float32_peak_flops=peak / 2,  # TF32: what XLA runs float32 matmuls as
        memory=memory,
        memory_bandwidth=hbm,
        bw_intra=nvlink,
        bw_inter=_dcn_share(dcn_per_host, 8),
        latency_intra=3.4e-6,
        latency_inter=9.6e-6,
        efficiency=efficiency,
        devices_per_host=8,
        sources=(*sources, _NCCL_LATENCY, _GPU_EFFICIENCY),
    )


def _tpu(name, peak, memory, hbm, ici, dcn, efficiency, slice_chips, *sources):
    """A TPU: ICI inside a slice (`devices_per_host`), DCN between slices; `dcn`: (bytes/s per
    direction of one TPU machine's NICs, chips per machine)."""
    return DeviceProfile(
        name,
        peak_flops=peak,
        memory=memory,
        memory_bandwidth=hbm,
        bw_intra=ici,
        bw_inter=_dcn_share(*dcn),
        latency_intra=1e-6,
        latency_inter=9.6e-6,  # NCCL's network figure: no TPU DCN latency is published
        efficiency=efficiency,
        devices_per_host=slice_chips,
        step_spread=TPU_STEP_SPREAD,
        sources=(*sources, _SCALING_BOOK, _STEP_SPREAD),
    )


_GPU_SCALED = round(A100_EFFICIENCY * H100_MAMF / A100_MAMF, 3)
# Data-center network per machine, bytes/s per direction. GPUs: the DGX compute fabric, one
# adapter per GPU (the storage / management NICs are left out).
GBIT = 1e9 / 8  # bytes/s in one Gb/s
DGX_A100_DCN = 8 * 200 * GBIT  # DGX A100 user guide: 8x ConnectX-6 HDR InfiniBand 200 Gb/s
DGX_H100_DCN = 8 * 400 * GBIT  # DGX H100 user guide: 8x ConnectX-7 NDR 400 Gb/s (OSFP)
DGX_H200_DCN = 8 * 400 * GBIT  # DGX H200 datasheet: 8x ConnectX-7 400 Gb/s (as DGX H100)
DGX_B200_DCN = 8 * 400 * GBIT  # DGX B200 datasheet: 8x ConnectX-7 400 Gb/s
# TPUs: (per machine, chips per machine).
TPU_V4_DCN = (2.5e10, 4)  # scaling-book Part 2: DCN ~2.5e10 B/s per host; 4 chips per v4 host
TPU_V5P_DCN = (4 * 50 * GBIT, 4)  # Cloud TPU v5p docs: 50 Gb/s DCN per chip, 4 chips per host
TPU_V5E_DCN = (2 * 100 * GBIT, 8)  # Cloud TPU v5e docs: 2 x 100 Gbps NICs per host of 8 chips
# (6.4 Tbps per 256-chip pod: the same 200 Gb/s for each of its 32 hosts)
PRESETS: dict[str, DeviceProfile] = {
    # NVLink 3: 300 GB/s per direction, NCCL models A100 at 235; one 200 Gb/s HDR adapter/GPU
    "a100-80gb": _gpu(
        "a100-80gb", 312e12, 80 * GB, 2.039e12, 235 * GB, DGX_A100_DCN, A100_EFFICIENCY,
        "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 156 TF32, 80 GB HBM2e 2,039 GB/s, "
        "NVLink 600 GB/s (both directions)",
        "NCCL src/graph/tuning.cc: A100 (sm80) NVLink bus bandwidth capped at 235 GB/s",
        "DGX A100 user guide: 8x ConnectX-6 HDR 200 Gb/s, one per GPU",
    ),
    # NVLink 4: 900 GB/s both directions; one 400 Gb/s NDR adapter per GPU
    "h100": _gpu(
        "h100", 989e12, 80 * GB, 3.35e12, 450 * GB, DGX_H100_DCN, _GPU_SCALED,
        "NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 80 GB HBM3 3.35 TB/s, NVLink "
        "900 GB/s",
        "DGX H100 user guide: 8x ConnectX-7 400 Gb/s, one per GPU",
        _MAMF,
    ),
    "h200": _gpu(
        "h200", 989e12, 141 * GB, 4.8e12, 450 * GB, DGX_H200_DCN, _GPU_SCALED,
        "NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 141 GB HBM3e 4.8 TB/s, NVLink "
        "900 GB/s",
        "DGX H200: 8x ConnectX-7 400 Gb/s, one per GPU",
        _MAMF,
    ),
    # NVLink 5: 1.8 TB/s both directions
    "b200": _gpu(
        "b200", 2250e12, 180 * GB, 8.0e12, 900 * GB, DGX_B200_DCN,
        round(A100_EFFICIENCY * B200_MAMF / A100_MAMF, 3),
        "NVIDIA DGX B200 datasheet: per GPU 2.25 PFLOP/s bf16 dense, 180 GB HBM3e 8 TB/s, "
        "NVLink 1.8 TB/s; 8x ConnectX-7 400 Gb/s",
        _MAMF,
    ),
    # efficiency solved from MaxText 22B on 1x v4-128 (a calibration run of published.py)
    "tpu-v4": _tpu(
        "tpu-v4", 275e12, 32 * 2**30, 1.2e12, 9e10, TPU_V4_DCN, 0.808, 64,
        "Cloud TPU v4 docs: 275 TFLOP/s bf16, 32 GiB HBM2 1,200 GB/s",
        "scaling-book Part 2: DCN ~2.5e10 B/s per host, 4 chips per host",
        "efficiency: solved from the calibration run, MaxText 22B on 1x v4-128 (MaxText "
        "configs/v4/README.md: 56.7% MFU, full remat)",
    ),
    "tpu-v5p": _tpu(
        "tpu-v5p", 459e12, 95 * 2**30, 2.765e12, 2e11, TPU_V5P_DCN, 0.808, 64,
        "Cloud TPU v5p docs: 459 TFLOP/s bf16, 95 GiB HBM 2,765 GB/s, DCN 50 Gb/s per chip",
        "efficiency: TPU v4's (same XLA TPU software; no v5p calibration run)",
    ),
    # efficiency solved from MaxText 16B on 1x v5e-256 (a calibration run of published.py)
    "tpu-v5e": _tpu(
        "tpu-v5e", 197e12, 16 * GB, 8.19e11, 1e11, TPU_V5E_DCN, 0.884, 256,
        "Cloud TPU v5e docs: 197 TFLOP/s bf16, 16 GB HBM2 819 GB/s, 8 chips per host, "
        "2 x 100 Gbps NICs per host, DCN 6.4 Tbps per 256-chip pod",
        "efficiency: solved from the calibration run, MaxText 16B on 1x v5e-256 (MaxText "
        "configs/v5e/README.md: 61.10% MFU, full remat)",
    ),
}  # fmt: skip
DEVICE_NAMES = (*PRESETS, "cpu")


def profile_path() -> str:
    """Where `python -m experiments.calibrate` stores the `cpu` profile: $JDDP_CPU_PROFILE, else
    $XDG_CACHE_HOME/jddp/cpu_profile.json (XDG_CACHE_HOME defaults to ~/.cache)."""
    if os.environ.get("JDDP_CPU_PROFILE"):
        return os.environ["JDDP_CPU_PROFILE"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "jddp", "cpu_profile.json")


def check_profile_path(path: str | None = None) -> str:
    """`path` (default `profile_path()`) once its folder exists and can be written; a
    ConfigError naming the path otherwise."""
    path = path or profile_path()
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise ConfigError(_unwritable(path, f"{e.filename} is a file, not a folder")) from None
    except OSError as e:
        raise ConfigError(_unwritable(path, f"{folder}: {e.strerror}")) from None
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        reason = f"{path} is a folder" if os.path.isdir(path) else f"{folder} is read-only"
        raise ConfigError(_unwritable(path, reason))
    return path


def _unwritable(path: str, reason: str) -> str:
    return (
        f"cannot store the cpu profile at {path} ({reason}); set JDDP_CPU_PROFILE to a file in "
        "a writable folder"
    )


def save_cpu_profile(profile: DeviceProfile, measurements: dict, path: str | None = None) -> str:
    """Writes the profile whole or not at all (jddp/runtime/atomic_write.py): a profile that
    was there stays intact if the write fails."""
    path = check_profile_path(path)
    record = dataclasses.asdict(profile) | {"measurements": measurements}
    try:
        atomic_write.write_json(path, record, indent=2)
    except OSError as e:
        raise ConfigError(_unwritable(path, e.strerror or str(e))) from None
    return path


def load_cpu_profile(path: str | None = None) -> DeviceProfile:
    """The stored `cpu` profile; a ConfigError saying how to make one if there is none."""
    path = path or profile_path()
    if not os.path.exists(path):
        raise ConfigError(
            f"no cpu profile at {path}; run `{CALIBRATE}` first (it measures this machine's "
            "matmul rate and collectives, ~2 min), or give every number "
            "(--peak_flops, --bw_intra, ...)"
        )
    try:
        with open(path) as f:
            record = json.load(f)
        record.pop("measurements", None)
        record["sources"] = tuple(record.get("sources", ()))
        record["combined_kinds"] = tuple(record.get("combined_kinds", ()))
        record["per_kind"] = tuple(tuple(k) for k in record.get("per_kind", ()))
        record["matmul_shape_rates"] = tuple(tuple(k) for k in record.get("matmul_shape_rates", ()))
        record.setdefault("every_group_crosses_hosts", True)  # XLA:CPU's, not a measurement
        record["partitioner_reduce_scatter"] = False  # XLA:CPU's too, whatever was stored
        profile = DeviceProfile(**record)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(
            f"cpu profile {path} is unreadable ({e}); run `{CALIBRATE}` again"
        ) from None
    profile.check()  # a hand-edited or truncated number: one line naming it, before any use
    return profile


def get_profile(name: str, cpu_profile_path: str | None = None) -> DeviceProfile:
    """The preset `name`, or the stored `cpu` profile; a ConfigError listing the names."""
    if name == "cpu":
        return load_cpu_profile(cpu_profile_path)
    if name not in PRESETS:
        raise ConfigError(f"unknown --device={name!r}; choose one of {', '.join(DEVICE_NAMES)}")
    return PRESETS[name]
