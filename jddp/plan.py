"""Plan before you launch: which strategy and mesh, how much memory, how fast.

    python -m jddp.plan --config=experiments/configs/gpt_1b.py --devices=1024 \\
        --devices_per_host=8 --device=h100 [--top=10] [--json]
    python -m jddp.plan --published [--json]     # the published runs and series it reproduces
    python -m experiments.calibrate              # (a checkout) measure this machine as --device=cpu

For ddp and every data x fsdp x tensor x stage mesh the model admits (zero1/2/3 where they
differ, auto where there is no stage axis, tensor meshes with and without sequence parallelism),
it prints the bytes one device
holds (exact state from shapes and partition rules; activations analytic for transformers, or
the compiled step's peak where it compiles here), the predicted step time split into compute,
exposed communication per mesh axis and pipeline bubble, tokens/s and MFU, and whether it fits,
best first. Nothing is compiled beyond 8 devices (`--compile`); the model is jddp/planner/.
"""

import json
import os
import re
import sys

from absl import app, flags

from jddp.run.cli import NUMBER, ConfigFlag, fail, fail_with, parse_amount
from jddp.runtime.quiet import quiet_library_logs

# The library's own defaults (jddp/run/config.py is a config file too): jddp never reads
# experiments/.
CONFIG = ConfigFlag(os.path.join(os.path.dirname(__file__), "run", "config.py"))
_DEVICES = flags.DEFINE_integer("devices", 8, "Number of devices to plan for.")
_DEVICES_PER_HOST = flags.DEFINE_integer(
    "devices_per_host",
    0,
    "Devices sharing the fast link (a GPU node's NVLink, a TPU slice's ICI); the tensor axis "
    "stays inside one. 0: the device's usual host (8 GPUs), at most --devices.",
)
_DEVICE = flags.DEFINE_string(
    "device", "h100", "Device preset: h100, h200, a100-80gb, b200, tpu-v4, tpu-v5p, tpu-v5e, cpu."
)
_PEAK = flags.DEFINE_string("peak_flops", "", "Peak FLOP/s per device (e.g. 989e12).")
_MEMORY = flags.DEFINE_string(
    "device_memory", "", "Memory per device: bytes or e.g. 80GB, 24GiB (KB/MB/GB/TB: 1000s)."
)
_BW_INTRA = flags.DEFINE_string(
    "bw_intra", "", "Bytes/s per device and direction inside a host (e.g. 450GB)."
)
_BW_INTER = flags.DEFINE_string("bw_inter", "", "Bytes/s per device and direction across hosts.")
_LAT_INTRA = flags.DEFINE_string("latency_intra", "", "Seconds per ring step inside a host.")
_LAT_INTER = flags.DEFINE_string("latency_inter", "", "Seconds per ring step across hosts.")
_EFFICIENCY = flags.DEFINE_float("efficiency", 0.0, "Fraction of peak compute reaches (0: preset).")
_STEP_SPREAD = flags.DEFINE_float(
    "step_spread",
    None,
    "Relative spread of one host's step time: a step waits for the slowest of the hosts "
    "(TPU slices) joined over the data-center network (unset: the preset's; 0: none).",
)
_TOP = flags.DEFINE_integer("top", 0, "Show the best K plans (0: all).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON document instead of a table.")
_STAGES = flags.DEFINE_bool("stages", True, "Plan meshes with pipeline stages too.")
_CONTEXTS = flags.DEFINE_bool(
    "contexts", True, "Plan meshes with a context axis too (transformers: long sequences)."
)
_COMPILE = flags.DEFINE_enum(
    "compile", "auto", ["auto", "yes", "no"],
    "Compile each step for N simulated CPU devices for its exact peak (auto: up to 8 devices).",
)  # fmt: skip
_PUBLISHED = flags.DEFINE_bool("published", False, "Reproduce published large-scale runs.")

_TIME_UNITS = {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_seconds(flag: str, text: str) -> float:
    match = re.fullmatch(NUMBER + r"(s|ms|us|ns)?\s*", text, re.IGNORECASE)
    if not match:
        fail(f"--{flag}={text!r} is not a duration; write e.g. 5us, 0.01ms, 3e-6")
    return float(match.group(1)) * _TIME_UNITS[(match.group(2) or "").lower()]


def device_profile():
    """The --device preset with every explicit number applied; exit 2 on a bad one."""
    import dataclasses

    from jddp.errors import JddpError
    from jddp.planner.devices import get_profile

    try:
        profile = get_profile(_DEVICE.value)
    except JddpError as e:
        fail_with(e)
    overrides = {}
    for flag, field, parse in (
        (_PEAK, "peak_flops", parse_amount),
        (_MEMORY, "memory", parse_amount),
        (_BW_INTRA, "bw_intra", parse_amount),
        (_BW_INTER, "bw_inter", parse_amount),
        (_LAT_INTRA, "latency_intra", parse_seconds),
        (_LAT_INTER, "latency_inter", parse_seconds),
    ):
        if flag.value:
            overrides[field] = parse(flag.name, flag.value)
    if _EFFICIENCY.value:
        overrides["efficiency"] = _EFFICIENCY.value
    if _STEP_SPREAD.value is not None:
        overrides["step_spread"] = _STEP_SPREAD.value
    if "peak_flops" in overrides:
        overrides["float32_peak_flops"] = 0.0  # the number given is the peak
    profile = dataclasses.replace(profile, **overrides)
    try:
        profile.check()
    except JddpError as e:
        fail_with(e)
    return profile


# ------------------------------------------------------------------------------ output
def _fmt_bytes(n: float) -> str:
    from jddp.observe.memory import format_bytes

    return format_bytes(n)


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def print_table(rows: list[dict], header: str) -> None:
    print(header)
    names = (
        "layout",
        "memory",
        "fits",
        "step",
        "compute",
        "exposed comm",
        "bubble",
        "tok/s",
        "MFU",
    )
    table = []
    for r in rows:
        comm = ", ".join(f"{a} {_fmt_seconds(s)}" for a, s in r["exposed_comm_s"].items() if s)
        if r["sync_s"]:  # waiting for the slowest host (jddp/planner/timing.py)
            comm = ", ".join(filter(None, (comm, f"slowest host {_fmt_seconds(r['sync_s'])}")))
        table.append(
            (
                r["layout"],
                _fmt_bytes(r["bytes_per_device"])
                + (" (compiled)" if r["memory_source"] == "compiled" else ""),
                "yes" if r["fits"] else "no",
                _fmt_seconds(r["predicted_step_s"]),
                _fmt_seconds(r["compute_s"]),
                comm or "-",
                _fmt_seconds(r["bubble_s"]) if r["bubble_s"] else "-",
                f"{r['predicted_tokens_per_s']:,.0f}",
                f"{r['predicted_mfu']:.1%}",
            )
        )
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(names)]
    for line in (names, *table):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def print_published(points: list[dict]) -> None:
    for p in points:
        role = "calibration" if p["calibration"] else "validation"
        print(f"{p['name']} ({role}, {p['device']}): {p['configuration']}")
        print(f"  source: {p['source']}")
        print(f"  published: {p['quote']}")
        error = p["predicted_mfu"] / p["published_mfu"] - 1
        print(
            f"  {p['metric']}: published {p['published_mfu']:.1%}, predicted "
            f"{p['predicted_mfu']:.1%} ({error:+.1%})"
        )
        best = p["best"]
        print(
            f"  planner's best mesh: {best['layout']}: {best['predicted_mfu']:.1%} "
            f"({best['gain']:+.1%} tokens/s against the published mesh)"
        )


def print_series(series: list[dict]) -> None:
    """Each series' fall from its first point to its last, published and predicted."""
    print("\nSeries, first to last point (rule: predicted drop within a third of the published):")
    for s in series:
        ends = f"{s['devices'][0]} -> {s['devices'][-1]} devices"
        published = f"{s['published'][0]:.1%} -> {s['published'][-1]:.1%}"
        predicted = f"{s['predicted'][0]:.1%} -> {s['predicted'][-1]:.1%}"
        verdict = ("within" if s["within_rule"] else "outside") + " the rule"
        print(f"{s['name']} ({ends}, {len(s['devices'])} points)")
        print(
            f"  published {published} (drop {s['published_drop'] * 100:.2f} points), "
            f"predicted {predicted} (drop {s['predicted_drop'] * 100:.2f}): " + verdict
        )


# -------------------------------------------------------------------------------- main
def run_published() -> None:
    from jddp.planner.published import published_points, series

    points = published_points()
    trends = series(points)
    if _JSON.value:
        print(json.dumps({"points": points, "series": trends}, indent=1))
    else:
        print_published(points)
        print_series(trends)


def run_plan() -> None:
    from jddp.errors import JddpError
    from jddp.planner import search
    from jddp.planner.workload import from_config
    from jddp.run.config import validate

    devices = _DEVICES.value
    profile = device_profile()
    per_host = min(_DEVICES_PER_HOST.value or profile.devices_per_host, devices)
    compile_steps = _COMPILE.value == "yes" or (_COMPILE.value == "auto" and devices <= 8)
    import jax  # configured before anything starts a backend

    jax.config.update("jax_platforms", "cpu")
    if compile_steps:
        jax.config.update("jax_num_cpu_devices", devices)
    config = CONFIG.value
    try:
        validate(config)
        workload = from_config(config)
        rows, _ = search.plan(
            workload, devices, profile, per_host, stages=_STAGES.value, contexts=_CONTEXTS.value
        )
        if compile_steps:
            from jddp.planner.compiled import compiled_peaks
            from jddp.planner.layouts import Layout

            layouts = {r["layout"]: r for r in rows}
            peaks = compiled_peaks(config, [_layout_of(r, Layout) for r in rows])
            for name, peak in peaks.items():
                row = layouts[name]
                row.update(bytes_per_device=peak, memory_source="compiled")
                row["fits"] = peak <= profile.memory
            rows = search.rank(rows)
    except JddpError as e:
        fail_with(e)
    shown = rows[: _TOP.value] if _TOP.value else rows
    fitting = [r for r in rows if r["fits"]]
    if _JSON.value:
        document = {
            "config": CONFIG.path,
            "devices": devices,
            "devices_per_host": per_host,
            "device": profile.name,
            "rows": shown,
        }
        print(json.dumps(document, indent=1))
    else:
        print_table(
            shown,
            f"{workload.name}, global batch {workload.global_batch}: {devices} x {profile.name} "
            f"({_fmt_bytes(profile.memory)}), {per_host} per host; best first",
        )
    if not fitting:
        best = min(rows, key=lambda r: r["bytes_per_device"])
        fail(
            f"fits nowhere: the closest plan is {best['layout']} at "
            f"{_fmt_bytes(best['bytes_per_device'])} per device, "
            f"{_fmt_bytes(best['bytes_per_device'] - profile.memory)} over the "
            f"{_fmt_bytes(profile.memory)} of a device; add devices, lower global_batch_size "
            "or raise grad_accum_steps, or turn on remat"
        )


def _layout_of(row: dict, layout_class):
    return layout_class(
        row["strategy"],
        sequence_parallel=row["sequence_parallel"],
        context_attention=row["context_attention"] or "ring",  # None: no context axis
        **row["mesh"],
    )


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}; flags look like --devices=8")
    if _DEVICES.value < 1:
        fail(f"--devices={_DEVICES.value} must be at least 1")
    per_host = _DEVICES_PER_HOST.value
    if per_host < 0:
        fail(f"--devices_per_host={per_host} must be at least 1, or 0 for the device's usual host")
    if per_host and _DEVICES.value % min(per_host, _DEVICES.value):
        fail(f"--devices_per_host={per_host} must divide --devices={_DEVICES.value}")
    if _TOP.value < 0:
        fail(f"--top={_TOP.value} must be a number of plans to show, or 0 for all of them")
    quiet_library_logs()
    if _PUBLISHED.value:
        run_published()
    else:
        run_plan()
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main, flags_parser=CONFIG.parse)
