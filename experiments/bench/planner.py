"""The planner against measurements on this machine: predicted vs measured step time, and the
modelled collective bytes against every compiled program's HLO.

    python -m experiments.bench.planner [--repeats 5] [--steps 3] [--out bench_results]
        [--no-processes] [--bytes]

Calibrates the `cpu` profile first, in the same run (bench_results/cpu_profile.json: the
machine's speed moves with its load), then times a GPT 4 x 256 (8 heads, 128 tokens, vocabulary
1,024, global batch 32, AdamW, float32) under ddp, zero1/2/3, hybrid and tensor meshes on 8
simulated devices (one process; interleaved windows, medians; the calibration GPT's step, flat
and stacked, is timed again in windows among theirs, and its time beside each layout's, round by
round, sets the efficiency and stacked-layers slowdown of that layout's prediction; it is timed
again after every 2-process launch, and its times after a layout's launches set that layout's
2-process prediction), and on 2 processes x 2 devices
(gloo between them; one launch per layout per round, rounds alternating the order), and
prints each layout's predicted step next to the measured one. Pipelines (a stage axis) run
1F1B over 4 micro-batches per step. `--bytes` compiles every
strategy and mesh of a tiny GPT on 8 simulated devices (with and without sequence
parallelism) and checks that jddp/planner/comm.py's bytes per (axes, kind) equal the HLO's.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

VOCAB, LAYERS, HEADS, WIDTH, SEQ, GLOBAL_BATCH = 1024, 4, 8, 256, 128, 32
IN_PROCESS = [  # (strategy, mesh) on 8 simulated devices
    ("ddp", None),
    ("zero1", "fsdp:8"),
    ("zero2", "fsdp:8"),
    ("zero3", "fsdp:8"),
    ("hybrid", "data:2,fsdp:4"),
    ("zero3", "fsdp:4,tensor:2"),
    ("zero3", "data:2,fsdp:2,tensor:2"),
    ("zero3", "tensor:8"),
    ("zero1", "stage:2,data:4"),  # pipelines: 1F1B, MICROBATCHES micro-batches per step
    ("zero3", "stage:2,fsdp:4"),
    ("zero1", "stage:4,data:2"),
]
PROCESSES = [  # 2 processes x 2 devices; the last mesh axis stays inside a process
    ("ddp", None),
    ("zero3", "fsdp:4"),
    ("hybrid", "data:2,fsdp:2"),
    ("zero3", "data:2,tensor:2"),
    ("zero1", "stage:2,data:2"),  # the stage axis across the processes
]
MICROBATCHES, SCHEDULE = 4, "1f1b"
# The calibration GPT's windows timed among the layouts': its layers one by one, and stacked.
CALIBRATION_FLAT, CALIBRATION_STACKED = "calibration GPT", "calibration GPT stacked"


def layout_of(strategy: str, mesh: str | None, devices: int):
    from jddp.planner.layouts import Layout

    if strategy == "ddp":
        return Layout("ddp", data=devices)
    sizes = {axis: int(size) for axis, size in (e.split(":") for e in mesh.split(","))}
    return Layout("zero3" if strategy == "hybrid" else strategy, **sizes)


def make_trainer(strategy: str, mesh: str | None, devices):
    """The GPT under `strategy` on `mesh`, laid out as jddp.experiment.build_trainer lays it."""
    import optax

    import jddp
    from jddp.models import GPT
    from jddp.models.gpt import TENSOR_PARALLEL_RULES
    from jddp.objectives import OBJECTIVES
    from jddp.pipeline import PipelineOptions
    from jddp.sharding.rules import fit_preset
    from jddp.strategies import device_mesh_for

    layout, tensor_axis, staged = {}, None, False
    if strategy != "ddp":
        device_mesh = device_mesh_for(strategy, mesh, devices)
        tensor_axis, staged = device_mesh.tensor_axis, device_mesh.stage_axis is not None
        rules = fit_preset(TENSOR_PARALLEL_RULES, device_mesh) if tensor_axis else ()
        layout = {"mesh": device_mesh, "rules": rules}
        if staged:
            layout["pipeline"] = PipelineOptions(microbatches=MICROBATCHES, schedule=SCHEDULE)
    model = GPT(
        VOCAB, num_layers=LAYERS, num_heads=HEADS, embed_dim=WIDTH, max_seq_len=SEQ,
        tensor_axis=tensor_axis, scan_layers=staged,
    )  # fmt: skip
    lm = OBJECTIVES["language_model"]
    return jddp.Trainer(
        model, lm.loss_fn, optax.adamw(1e-3), metrics=dict(lm.metrics), input_key="inputs",
        strategy=strategy, devices=devices, log_grad_norm=False, **layout,
    )  # fmt: skip


def workload():
    import optax

    from jddp.models import GPT
    from jddp.models.gpt import TENSOR_PARALLEL_RULES
    from jddp.planner.workload import model_workload
    from jddp.sharding.rules import fit_preset

    model = GPT(VOCAB, num_layers=LAYERS, num_heads=HEADS, embed_dim=WIDTH, max_seq_len=SEQ)
    return model_workload(
        model,
        np.zeros((1, SEQ), np.int32),
        GLOBAL_BATCH,
        optax.adamw(1e-3),
        name="GPT 4x256",
        rules_for=lambda m: fit_preset(TENSOR_PARALLEL_RULES, m) if m.size("tensor") > 1 else (),
        microbatches=MICROBATCHES,
        pipeline_schedule=SCHEDULE,
    )


def batch():
    tokens = np.random.default_rng(0).integers(0, VOCAB, (GLOBAL_BATCH, SEQ + 1))
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}


def name_of(strategy, mesh):
    return f"{strategy} {mesh or 'batch:N'}"


# ------------------------------------------------------------------------- measurements
def in_process_seconds(repeats: int, steps: int, extra_windows=None) -> dict[str, tuple]:
    """(median seconds, minor page faults, seconds in each round) per step of each in-process
    layout and of each of
    `extra_windows` ({name: a window of `steps` steps returning its seconds}), all windows
    interleaved after a warm-up to the steady state (`common.warm_up`)."""
    import jax

    from experiments.bench import common

    runs = {}
    for strategy, mesh in IN_PROCESS:
        trainer = make_trainer(strategy, mesh, jax.devices())
        state = trainer.init(seed=0, sample_batch=batch())
        runs[name_of(strategy, mesh)] = [trainer, state, trainer.place_batch(batch())]
    windows = common.trainer_windows(runs, steps) | (extra_windows or {})
    common.warm_up(windows)
    timings = common.interleaved_medians(windows, repeats)
    return {
        name: (*_per_step(t, repeats, steps), [s / steps for s in t["all_sec"]])
        for name, t in timings.items()
    }


def _per_step(timing: dict, repeats: int, steps: int) -> tuple[float, float]:
    """(median seconds, minor page faults) per step of `timing` (interleaved_medians')."""
    return timing["median_sec"] / steps, timing["minor_faults"] / (repeats * steps)


def worker(strategy: str, mesh: str | None, repeats: int, steps: int) -> None:
    """One process of a 2 x 2 run: median seconds and page faults per step over `repeats`
    windows, after a warm-up to the steady state."""
    from jddp import runtime

    runtime.initialize()
    import jax
    from jax.experimental import multihost_utils

    from experiments.bench import common

    trainer = make_trainer(strategy, mesh, jax.devices())
    part, parts = trainer.batch_part  # a stage axis across the processes: both read all rows
    rows = GLOBAL_BATCH // parts
    local = {k: v[part * rows : (part + 1) * rows] for k, v in batch().items()}
    state = trainer.init(seed=0, sample_batch=local)
    placed = trainer.place_batch(local)

    windows = common.trainer_windows({"launch": [trainer, state, placed]}, steps)

    def agree(settled):  # both processes must run the same windows
        return bool(multihost_utils.process_allgather(np.asarray(settled)).all())

    common.warm_up(windows, agree)
    timing = common.interleaved_medians(windows, repeats)["launch"]
    seconds, faults = _per_step(timing, repeats, steps)
    if jax.process_index() == 0:
        print(f"RESULT {seconds} {faults}", flush=True)


def process_seconds(rounds: int, repeats: int, steps: int, after_each=None) -> dict[str, list]:
    """{layout: [(median seconds, page faults of process 0) per step of each launch]},
    launches alternating per round;
    `after_each(layout)` runs after every launch."""
    out = {name_of(s, m): [] for s, m in PROCESSES}
    for round_index in range(rounds):
        order = PROCESSES if round_index % 2 == 0 else PROCESSES[::-1]
        for strategy, mesh in order:
            command = [
                sys.executable, "-m", "jddp.launch", "--nproc=2", "--devices_per_proc=2", "--",
                sys.executable, "-m", "experiments.bench.planner", "--worker",
                json.dumps([strategy, mesh, repeats, steps]),
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True, timeout=900)
            lines = [ln for ln in result.stdout.splitlines() if ln.startswith("[0] RESULT ")]
            if not lines:
                raise RuntimeError(f"{strategy} {mesh} failed:\n{result.stdout[-3000:]}")
            seconds, faults = lines[-1].split()[2:]
            out[name_of(strategy, mesh)].append((float(seconds), float(faults)))
            if after_each:
                after_each(name_of(strategy, mesh))
    return out


# ------------------------------------------------------------------------------- bytes
def byte_check() -> list[dict]:
    """Every layout of the tiny test GPT on 8 devices: modelled bytes vs the HLO's."""
    import jax

    from jddp.hlo import bytes_by_axes, collective_ops
    from jddp.planner import comm
    from jddp.planner.search import layouts_for
    from tests.planner_programs import compiled_text, tiny_workload

    w = tiny_workload(heads=8)
    layouts, _ = layouts_for(w, 8, 8, stages=False)  # pipelines: tests/test_planner_comm.py
    rows = []
    for layout in layouts:
        start = time.perf_counter()
        text, names, ids = compiled_text(layout, heads=8)
        hlo = bytes_by_axes(collective_ops(text), ids, names)
        model = comm.bytes_by_axes(comm.step_collectives(w, layout))
        rows.append(
            {
                "layout": layout.name,
                "hlo_bytes": sum(hlo.values()),
                "model_bytes": int(sum(model.values())),
                "equal_per_axis_and_kind": hlo == model,
                "compile_s": time.perf_counter() - start,
            }
        )
        print(rows[-1], flush=True)
    assert jax.device_count() == 8
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="launches per 2-process layout")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--no-processes", action="store_true")
    parser.add_argument("--bytes", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*json.loads(args.worker))
        return
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from experiments.bench import common

    if args.bytes:
        rows = byte_check()
        common.report(
            "planner_bytes",
            rows,
            {"all_equal": all(r["equal_per_axis_and_kind"] for r in rows)},
            args.out,
        )
        return

    from jddp.planner.calibrate import calibrate, gpt_copies_step
    from jddp.planner.devices import load_cpu_profile, save_cpu_profile
    from jddp.planner.timing import predict

    load = os.getloadavg()[0]
    profile_file = os.path.join(args.out, "cpu_profile.json")
    _, measurements = calibrate(profile_file)
    profile = load_cpu_profile(profile_file)
    start_efficiency, across_efficiency, between = profile.efficiency, None, {}
    calibration = {
        name: gpt_copies_step(jax.devices(), scan_layers)
        for name, scan_layers in ((CALIBRATION_FLAT, False), (CALIBRATION_STACKED, True))
    }
    windows = {name: steps_window(run, args.steps) for name, (run, _) in calibration.items()}
    measured = in_process_seconds(args.repeats, args.steps, windows)
    profile = calibrated(profile, calibration, {n: measured[n][0] for n in calibration})
    measurements["interleaved_gpt_step_seconds"] = [measured[n][0] for n in calibration]
    # A reference window that takes page faults runs slow and skews every prediction.
    calibration_faults = {n: measured[n][1] for n in calibration}
    # The run's profile, from the medians; each prediction below uses the calibration GPT's
    # time beside its own layout's instead, round by round.
    save_cpu_profile(profile, measurements, profile_file)

    model = workload()

    def calibrated_beside(seconds: list, reference: dict):
        beside_seconds = {n: beside(seconds, reference[n]) for n in calibration}
        return calibrated(profile, calibration, beside_seconds)

    rows = []
    for strategy, mesh in IN_PROCESS:
        name = name_of(strategy, mesh)
        seconds, faults, rounds = measured[name]
        beside_profile = calibrated_beside(rounds, {n: measured[n][2] for n in calibration})
        p = predict(model, layout_of(strategy, mesh, 8), beside_profile, 8)
        row = _row(name, "1 x 8", seconds, faults, p)
        rows.append(row | {"rounds_ms": ms(rounds), "efficiency": beside_profile.efficiency})
    if not args.no_processes:
        # The calibration GPT again after every launch: the launches run later than the
        # in-process windows, and the machine's speed drifts between the two parts.
        between = {name: [] for name in calibration}
        after = {name_of(s, m): {name: [] for name in calibration} for s, m in PROCESSES}

        def time_calibration(layout):
            for name, window in windows.items():
                between[name].append(window() / args.steps)
                after[layout][name].append(between[name][-1])

        launches = process_seconds(args.rounds, args.repeats, args.steps, time_calibration)
        across_efficiency = calibrated(
            profile, calibration, {n: statistics.median(t) for n, t in between.items()}
        ).efficiency
        for strategy, mesh in PROCESSES:
            name = name_of(strategy, mesh)
            seconds, faults = zip(*launches[name], strict=True)
            beside_profile = calibrated_beside(seconds, after[name])
            p = predict(model, layout_of(strategy, mesh, 4), beside_profile, 2)
            row = _row(name, "2 x 2", statistics.median(seconds), max(faults), p)
            rows.append(row | {"rounds_ms": ms(seconds), "efficiency": beside_profile.efficiency})
    common.report(
        "planner",
        rows,
        {
            "model": f"GPT {LAYERS}x{WIDTH}, {HEADS} heads, vocab {VOCAB}, seq {SEQ}",
            "global_batch": GLOBAL_BATCH,
            "matmul_gflops": profile.peak_flops / 1e9,
            "efficiency": profile.efficiency,
            "efficiency_at_calibration": start_efficiency,
            "efficiency_between_launches": across_efficiency,
            "calibration_page_faults_per_step": calibration_faults,
            "calibration_rounds_ms": {n: ms(measured[n][2]) for n in calibration},
            "calibration_between_launches_ms": {n: ms(t) for n, t in between.items()},
            "load_average_start": load,
            "load_average_end": os.getloadavg()[0],
            "max_abs_error": max(abs(r["predicted_over_measured"] - 1) for r in rows),
        },
        args.out,
    )


def steps_window(run, steps: int):
    """A window of `steps` calls of `run()`, returning its seconds."""

    def window() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            run()
        return time.perf_counter() - start

    return window


def beside(seconds: list, reference: list) -> float:
    """The reference's seconds as they stood beside `seconds`, round by round: the median of
    `seconds` over the median ratio of `seconds[i]` to `reference[i]`, each pair timed in the
    same round. The machine's speed moves between rounds (the calibration GPT's rounds of one
    run spread by 1.2-1.4x); a ratio inside a round cancels what moved."""
    from experiments.bench import common

    pair = {"layout": {"all_sec": seconds}, "reference": {"all_sec": reference}}
    return statistics.median(seconds) / common.paired_ratio(pair, "reference", "layout")


def calibrated(profile, calibration: dict, seconds: dict):
    """`profile` with the efficiency and stacked-layers slowdown of the calibration GPT's
    step `seconds` ({name: seconds}), timed among the layouts' own. The machine's speed drifts
    within a run (two runs' calibrations, each timed once before the layouts, gave efficiencies
    of 0.719 and 0.578 an hour apart): a prediction is compared with a measurement at the rate
    the machine had while it was measured."""
    from jddp.planner.calibrate import efficiency_of

    def efficiency(name):
        return efficiency_of(seconds[name], calibration[name][1], 8, profile)

    flat, stacked = efficiency(CALIBRATION_FLAT), efficiency(CALIBRATION_STACKED)
    return dataclasses.replace(profile, efficiency=flat, stacked_layers_slowdown=flat / stacked)


def ms(seconds: list) -> list:
    return [round(s * 1e3, 1) for s in seconds]


def _row(name, processes, measured, faults, prediction) -> dict:
    return {
        "layout": name,
        "processes_x_devices": processes,
        "measured_ms": measured * 1e3,
        "predicted_ms": prediction.step_s * 1e3,
        "predicted_over_measured": prediction.step_s / measured,
        "compute_ms": prediction.compute_s * 1e3,
        "exposed_comm_ms": prediction.exposed_total * 1e3,
        "page_faults_per_step": faults,  # after the warm-up; ~0: the heap had settled
    }


if __name__ == "__main__":
    main()
