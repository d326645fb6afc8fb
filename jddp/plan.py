"""Plan before you launch: per-device memory of every strategy for a config, from XLA itself.

    python -m jddp.plan --config=experiments/configs/digits_mlp.py --devices=8 \
        --device_memory=80GB [--devices_per_host=8] [--config.KEY=VALUE ...]

For each strategy it prints the bytes one device holds of parameters, averaged gradients and
optimizer state (from `jax.eval_shape` and the partition rules: exact), and the compiled train
step's peak (XLA's `memory_analysis` of the real step, compiled for N simulated CPU devices: an
accelerator's compiler fuses differently, so treat the peak as close, not exact). It says which
strategies fit; if none does, it says by how much the best one is over and exits with code 2.
"""

import math
import os
import re

from absl import app, flags

from jddp.cli import ConfigFlag, fail, quiet_library_logs

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hybrid")

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
    "Devices per host, for hybrid's mesh (replica = devices / this); 0 = all devices on one host.",
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


def _per_device_bytes(tree, specs, mesh_shape) -> int:
    import jax

    def shard_bytes(x, spec):
        axes = [
            a
            for entry in spec
            if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))
        ]
        return x.size * x.dtype.itemsize // math.prod(mesh_shape[a] for a in axes)

    return sum(jax.tree.leaves(jax.tree.map(shard_bytes, tree, specs)))


def plan(config, num_devices: int, devices_per_host: int) -> list[dict]:
    """One row per strategy: per-device bytes of each kind and the compiled step's peak."""
    import jax
    import numpy as np

    from jddp import data, optim
    from jddp.experiment import build_trainer
    from jddp.memory import peak_bytes

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
    hosts = num_devices // (devices_per_host or num_devices)
    rows = []
    for name in STRATEGIES:
        mesh = f"replica:{hosts},shard:-1" if name == "hybrid" else None
        trainer = build_trainer(config, dataset, schedule, strategy=name, mesh=mesh)
        state = jax.eval_shape(
            trainer.task.init_state, jax.random.key(0), sample[trainer.task.input_key]
        )
        state_specs, grad_specs = trainer.strategy.layout(state)
        mesh_shape = dict(trainer.strategy.mesh.shape)
        args = trainer.strategy.abstract_inputs(state, batch)
        compiled = trainer.strategy.lower_train_step(*args).compile()
        rows.append(
            {
                "strategy": name,
                "mesh": ",".join(f"{a}:{s}" for a, s in mesh_shape.items()),
                "params": _per_device_bytes(state.params, state_specs.params, mesh_shape),
                "grads": _per_device_bytes(state.params, grad_specs, mesh_shape),
                "optimizer": _per_device_bytes(state.opt_state, state_specs.opt_state, mesh_shape),
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
    fitting = [r["strategy"] for r in rows if r["peak"] <= memory]
    if not fitting:
        best = min(rows, key=lambda r: r["peak"])
        fail(
            f"fits nowhere: the smallest step peak is {best['strategy']}'s "
            f"{format_bytes(best['peak'])} per device, {format_bytes(best['peak'] - memory)} over "
            f"the {format_bytes(memory)} of a device; add devices, lower global_batch_size or "
            "raise grad_accum_steps, or use bfloat16 compute"
        )
    print(f"fits: {', '.join(fitting)}")


if __name__ == "__main__":
    app.run(main, flags_parser=CONFIG.parse)
