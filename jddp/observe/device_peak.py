"""The peak FLOP/s of a device, the denominator of MFU: a datasheet table for common GPUs and
TPUs, the measured matmul rate on CPU, or a value you give.

Table values are dense (no sparsity) bfloat16 tensor-core / MXU peaks from the vendors'
datasheets. float32 compute: NVIDIA GPUs run float32 matmuls as TF32 by default in XLA (half the
bfloat16 peak); TPUs run them as bfloat16 passes (the same peak).
"""

import functools
import time

import jax
import jax.numpy as jnp

# (lower-case substring of `device.device_kind`, bfloat16 dense peak FLOP/s); first match wins.
BF16_PEAK_FLOPS = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", 989e12),
    ("h200", 989e12),
    ("h800", 989e12),
    ("b200", 2250e12),
    ("a100", 312e12),
    ("l40s", 362e12),
    ("l4", 121e12),
    ("tpu v2", 45e12),
    ("tpu v3", 123e12),
    ("tpu v4", 275e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),
    ("tpu v6 lite", 918e12),
    ("tpu v6e", 918e12),
)
MATMUL_SIZE = 2048


def matmul_timer(device: jax.Device, dtype_name: str = "float32", count: int = 1):
    """A compiled, warmed-up `MATMUL_SIZE`^3 matmul on `device`: calling the result times `count`
    of them and returns seconds per matmul (the rate is 2 MATMUL_SIZE^3 / that)."""
    a = jax.device_put(jnp.ones((MATMUL_SIZE, MATMUL_SIZE), dtype_name), device)
    matmul = jax.jit(jnp.dot)
    matmul(a, a).block_until_ready()

    def seconds_per_matmul() -> float:
        start = time.perf_counter()
        for _ in range(count):
            matmul(a, a).block_until_ready()
        return (time.perf_counter() - start) / count

    return seconds_per_matmul


@functools.cache
def measured_matmul_rate(device: jax.Device, dtype_name: str = "float32") -> float:
    """FLOP/s of a `MATMUL_SIZE`^3 matmul through XLA on `device`: the best of 3 after a warmup
    (about a second on a CPU)."""
    timer = matmul_timer(device, dtype_name)
    return 2 * MATMUL_SIZE**3 / min(timer() for _ in range(3))


def table_peak(device: jax.Device, dtype_name: str) -> float | None:
    kind = device.device_kind.lower()
    for pattern, bf16_peak in BF16_PEAK_FLOPS:
        if pattern in kind:
            tf32 = dtype_name == "float32" and device.platform == "gpu"
            return bf16_peak / 2 if tf32 else bf16_peak
    return None


def peak_flops_per_device(
    device: jax.Device, dtype_name: str = "float32", override: float = 0.0
) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where it came from). `override` > 0 wins. On CPU: the measured
    matmul rate shared by the process's CPU devices (simulated devices share the same cores)."""
    if override > 0:
        return override, "config"
    if device.platform == "cpu":
        rate = measured_matmul_rate(device, dtype_name)
        return rate / jax.local_device_count("cpu"), f"measured {MATMUL_SIZE}^3 {dtype_name} matmul"
    peak = table_peak(device, dtype_name)
    if peak is None:
        return None, f"unknown device kind {device.device_kind!r}: set peak_flops_per_device"
    return peak, f"datasheet ({device.device_kind}, {dtype_name})"
