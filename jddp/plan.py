"""Plan before you launch: per-device memory of every strategy and mesh for a config, from XLA.

    python -m jddp.plan --config=experiments/configs/digits_mlp.py --devices=8 \
        --device_memory=80GB [--devices_per_host=8] [--config.KEY=VALUE ...]

It lists ddp and every factorization of the devices into data x fsdp x tensor that the model
admits, under each ZeRO stage that differs there (with fsdp:1 the stages are all one, listed as
zero3), and prints the bytes one device holds of parameters, averaged gradients and optimizer
state (from `jax.eval_shape` and the partition rules: exact), and the compiled train step's peak
(XLA's `memory_analysis` of the real step, compiled for N simulated CPU devices: an
accelerator's compiler fuses differently, so treat the peak as close, not exact). It says which
plans fit; if none does, it says by how much the best one is over and exits with code 2.
`--devices_per_host` keeps the tensor axis inside a host.
"""

import os
import re

from absl import app, flags

from jddp.cli import ConfigFlag, fail, quiet_library_logs

# The library's own defaults (jddp/config.py is a config file too): jddp never reads experiments/.
CONFIG = ConfigFlag(os.path.join(os.path.dirname(__file__), "config.py"))
_DEVICES = flags.DEFINE_integer("devices", 8, "Number of devices to plan for.")
_DEVICE_MEMORY = flags.DEFINE_string(
    "device_memory",
    "80GB",
    "Memory of one device: bytes, or a number with KB/MB/GB/TB "
    "(powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024).",
)
_DEVICES_PER_HOST = flags.DEFINE_integer(
    "devices_per_host",
    0,
    "Devices per host: the tensor axis stays inside one; 0 = all devices on one host.",
)

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        fail(f"--device_memory={text!r} is not a size; write e.g. 80GB, 24GiB or 16000000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def factorizations(num_devices: int, tensor_limit: int) -> list[dict[str, int]]:
    """Every {data, fsdp, tensor} whose product is `num_devices`, tensor at most `tensor_limit`
    (the devices of one host), data-major."""
    divisors = [n for n in range(1, num_devices + 1) if num_devices % n == 0]
    meshes = []
    for tensor in divisors:
        for data in divisors:
            if tensor <= tensor_limit and (num_devices // tensor) % data == 0:
                meshes.append(
                    {"data": data, "fsdp": num_devices // tensor // data, "tensor": tensor}
                )
    return sorted(meshes, key=lambda m: (m["tensor"], m["data"]))


def candidates(num_devices: int, devices_per_host: int) -> list[tuple[str, str | None]]:
    """(strategy, mesh spec) pairs to plan: ddp, then each stage on each mesh where it differs."""
    plans = [("ddp", None)]
    for mesh in factorizations(num_devices, devices_per_host or num_devices):
        if mesh["fsdp"] == 1 and mesh["tensor"] == 1:
            continue  # only replicas: that is ddp
        spec = ",".join(f"{role}:{size}" for role, size in mesh.items() if size > 1)
        stages = ("zero1", "zero2", "zero3") if mesh["fsdp"] > 1 else ("zero3",)
        plans += [(stage, spec) for stage in stages]
    return plans


def plan(config, num_devices: int, devices_per_host: int) -> list[dict]:
    """One row per (strategy, mesh) the model admits: per-device bytes of each kind and the
    compiled step's peak. Meshes the model cannot split over (a tensor axis it has no rules
    for, heads that do not divide) are left out."""
    import jax
    import numpy as np

    from jddp import data, optim
    from jddp.errors import ConfigError
    from jddp.experiment import build_trainer
    from jddp.memory import peak_bytes, sharded_bytes

    dataset = data.get_dataset(config.dataset, config.data.get("text_file", ""))
    schedule = optim.learning_rate_schedule(config)
    # One real example gives the shapes (the dataset is prepared if it is not yet).
    sample = data.open_dataset(dataset, data.DataOptions.from_config(config.data)).sample_batch()
    batch = {
        name: jax.ShapeDtypeStruct(
            (config.global_batch_size, *np.shape(x)[1:]), np.asarray(x).dtype
        )
        for name, x in sample.items()
    }
    rows = []
    for name, mesh in candidates(num_devices, devices_per_host):
        try:
            trainer = build_trainer(config, dataset, schedule, strategy=name, mesh=mesh)
            state = trainer.abstract_state(sample)
        except ConfigError:
            continue  # the model does not split this way
        state_specs, grad_specs = trainer.strategy.layout()
        mesh_shape = dict(trainer.strategy.mesh.shape)
        placed = trainer.strategy.abstract_batch(batch)
        compiled = trainer.strategy.lower_train_step(state, placed).compile()
        rows.append(
            {
                "strategy": name,
                "mesh": ",".join(f"{a}:{s}" for a, s in mesh_shape.items()),
                "params": sharded_bytes(state.params, state_specs.params, mesh_shape),
                "grads": sharded_bytes(state.params, grad_specs, mesh_shape),
                "optimizer": sharded_bytes(state.opt_state, state_specs.opt_state, mesh_shape),
                "peak": peak_bytes(compiled),
            }
        )
    return rows


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}; flags look like --devices=8")
    if _DEVICES.value < 1:
        fail(f"--devices={_DEVICES.value} must be at least 1")
    per_host = _DEVICES_PER_HOST.value
    if per_host < 0 or (per_host and _DEVICES.value % per_host):
        fail(f"--devices_per_host={per_host} must divide --devices={_DEVICES.value}")
    memory = parse_bytes(_DEVICE_MEMORY.value)
    quiet_library_logs()

    import jax  # configured before anything starts a backend

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", _DEVICES.value)
    from jddp.config import validate
    from jddp.errors import JddpError
    from jddp.memory import format_bytes

    config = CONFIG.value
    try:
        validate(config)
        rows = plan(config, _DEVICES.value, per_host)
    except JddpError as e:
        fail(str(e))

    print(
        f"{config.model} on {config.dataset}, global batch {config.global_batch_size}, "
        f"{_DEVICES.value} devices of {format_bytes(memory)}; bytes per device:"
    )
    header = ("strategy", "mesh", "params", "grads", "optimizer", "step peak", "fits")
    table = [
        (
            r["strategy"],
            r["mesh"],
            format_bytes(r["params"]),
            format_bytes(r["grads"]),
            format_bytes(r["optimizer"]),
            format_bytes(r["peak"]),
            "yes" if r["peak"] <= memory else f"no, {format_bytes(r['peak'] - memory)} over",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    for line in (header, *table):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
    fitting = [f"{r['strategy']} {r['mesh']}" for r in rows if r["peak"] <= memory]
    if not fitting:
        best = min(rows, key=lambda r: r["peak"])
        fail(
            f"fits nowhere: the smallest step peak is {best['strategy']}'s on "
            f"{best['mesh']}, {format_bytes(best['peak'])} per device, "
            f"{format_bytes(best['peak'] - memory)} over "
            f"the {format_bytes(memory)} of a device; add devices, lower global_batch_size or "
            "raise grad_accum_steps, or use bfloat16 compute"
        )
    print(f"fits: {'; '.join(fitting)}")


if __name__ == "__main__":
    app.run(main, flags_parser=CONFIG.parse)
