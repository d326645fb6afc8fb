"""The planner against measurements on this machine: predicted vs measured step time, and the
modelled collective bytes against every compiled program's HLO.

    python -m experiments.bench.planner [--repeats 5] [--steps 3] [--out bench_results]
        [--no-processes] [--bytes] [--traffic]

Calibrates the `cpu` profile first, in the same run (bench_results/cpu_profile.json: the
machine's speed moves with its load), then times a GPT 4 x 256 (8 heads, 128 tokens, vocabulary
1,024, global batch 32, AdamW, float32) under ddp, zero1/2/3, hybrid, tensor and pipeline
meshes on 8 simulated devices in one process, and on 2 processes x 2 devices (gloo between
them; one launch per layout per round, rounds alternating the order), and prints each
layout's predicted step next to the measured one (medians of windows of `--steps` steps).
Every window of a layout runs right between two windows of the calibration GPT (each device
training its own copy; and its layers stacked, beside a pipeline) on the same devices, in the
same process or processes: the calibration GPT's time beside each window sets the efficiency
(and stacked-layers slowdown) of that layout's prediction. Pipelines (a stage axis) run 1F1B
over 4 micro-batches per step. `--bytes` compiles every
strategy and mesh of a tiny GPT on 8 simulated devices (with and without sequence
parallelism) and checks that jddp/planner/comm.py's bytes per (axes, kind) equal the HLO's.
`--traffic` compiles this GPT's layouts without stages and the calibration GPT and prints the
bytes each step's non-matmul ops move against the planner's count of them. Every window's time
is written to planner_timings.json as soon as it is measured.
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
    """The GPT under `strategy` on `mesh`, laid out as jddp.run.factory.build_trainer lays it."""
    import optax

    import jddp
    from jddp.models import GPT
    from jddp.models.gpt import TENSOR_PARALLEL_RULES
    from jddp.parallel.pipeline import PipelineOptions
    from jddp.parallel.rules import adapt_preset
    from jddp.parallel.strategies import device_mesh_for
    from jddp.run.objectives import OBJECTIVES

    device_mesh = device_mesh_for(strategy, mesh, devices)
    tensor_axis, staged = device_mesh.tensor_axis, device_mesh.stage_axis is not None
    model = GPT(
        VOCAB, num_layers=LAYERS, num_heads=HEADS, embed_dim=WIDTH, max_seq_len=SEQ,
        tensor_axis=tensor_axis, scan_layers=staged,
    )  # fmt: skip
    lm = OBJECTIVES["language_model"]
    return jddp.Trainer(
        model, lm.loss_fn, optax.adamw(1e-3), metrics=dict(lm.metrics), input_key="inputs",
        strategy=strategy, mesh=device_mesh, log_grad_norm=False,
        rules=adapt_preset(TENSOR_PARALLEL_RULES, device_mesh) if tensor_axis else (),
        pipeline=PipelineOptions(microbatches=MICROBATCHES, schedule=SCHEDULE),
    )  # fmt: skip


def workload():
    import optax

    from jddp.models import GPT
    from jddp.models.gpt import TENSOR_PARALLEL_RULES
    from jddp.parallel.rules import adapt_preset
    from jddp.planner.workload import model_workload

    model = GPT(VOCAB, num_layers=LAYERS, num_heads=HEADS, embed_dim=WIDTH, max_seq_len=SEQ)
    return model_workload(
        model,
        np.zeros((1, SEQ), np.int32),
        GLOBAL_BATCH,
        optax.adamw(1e-3),
        name="GPT 4x256",
        rules_for=lambda m: adapt_preset(TENSOR_PARALLEL_RULES, m) if m.size("tensor") > 1 else (),
        microbatches=MICROBATCHES,
        pipeline_schedule=SCHEDULE,
    )


def batch():
    tokens = np.random.default_rng(0).integers(0, VOCAB, (GLOBAL_BATCH, SEQ + 1))
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}


def name_of(strategy, mesh):
    return f"{strategy} {mesh or 'batch:N'}"


# ------------------------------------------------------------------------- measurements
def references_of(name: str) -> tuple[str, ...]:
    """The calibration GPT windows a layout's windows are timed between: a pipeline's stages
    run their layers stacked, and its prediction needs the stacked one's slowdown too."""
    return (CALIBRATION_FLAT, CALIBRATION_STACKED) if "stage:" in name else (CALIBRATION_FLAT,)


def calibration_windows(devices, steps: int, stacked: bool = True) -> dict:
    """{name: (a window of `steps` steps of the calibration GPT on `devices`, returning its
    seconds; the planner's workload of it)}: each device trains its own copy
    (experiments/calibrate/measure.py `gpt_copies_step`), flat and, with `stacked`, with its
    layers stacked."""
    from experiments.calibrate.measure import gpt_copies_step

    kinds = ((CALIBRATION_FLAT, False), (CALIBRATION_STACKED, True))[: 2 if stacked else 1]
    out = {}
    for name, scan_layers in kinds:
        copies = gpt_copies_step(devices, scan_layers)
        out[name] = (steps_window(copies.run, steps), copies.workload)
    return out


def timed_between_references(
    runs: dict[str, list], references: dict, repeats: int, steps: int, agree=all, start=None
) -> dict[str, dict]:
    """Per step of each layout in `runs` ({name: [trainer, state, placed batch]}) and of each
    reference window: {name: {"faults": minor page faults, "rounds": each window's seconds, and
    for a layout "beside": {reference: the mean of its windows just before and after each of
    the layout's}}}, after a warm-up to the steady state (`common.warm_up`).
    `start()`, if given, runs before every window, untimed."""
    from experiments.bench import common

    windows = common.trainer_windows(runs, steps)
    if start is not None:
        windows, references = (
            {n: _after(start, w) for n, w in d.items()} for d in (windows, references)
        )
    common.warm_up(windows | references, agree)
    timings = common.between_references(windows, references, references_of, repeats)
    return {
        name: {
            "faults": t["minor_faults"] / (len(t["all_sec"]) * steps),
            "rounds": [s / steps for s in t["all_sec"]],
            "beside": {r: [s / steps for s in b] for r, b in t.get("beside", {}).items()},
        }
        for name, t in timings.items()
    }


def _after(start, window):
    def run() -> float:
        start()
        return window()

    return run


def in_process_timings(repeats: int, steps: int, references: dict) -> dict[str, dict]:
    """`timed_between_references` for every in-process layout on this process's 8 devices."""
    import jax

    runs = {}
    for strategy, mesh in IN_PROCESS:
        trainer = make_trainer(strategy, mesh, jax.devices())
        state = trainer.init(seed=0, sample_batch=batch())
        runs[name_of(strategy, mesh)] = [trainer, state, trainer.place_batch(batch())]
    return timed_between_references(runs, references, repeats, steps)


def worker(strategy: str, mesh: str | None, repeats: int, steps: int) -> None:
    """One process of a 2 x 2 run: the layout's windows, each between windows of the
    calibration GPT on the job's 4 devices (its copies need no communication: each process
    runs its own 2, at the same time as the other's), as `timed_between_references`."""
    from jddp.runtime import processes as runtime

    runtime.initialize()
    import jax
    from jax.experimental import multihost_utils

    trainer = make_trainer(strategy, mesh, jax.devices())
    part, parts = trainer.row_block  # a stage axis across the processes: both read all rows
    rows = GLOBAL_BATCH // parts
    local = {k: v[part * rows : (part + 1) * rows] for k, v in batch().items()}
    state = trainer.init(seed=0, sample_batch=local)
    name = name_of(strategy, mesh)
    runs = {name: [trainer, state, trainer.place_batch(local)]}
    windows = calibration_windows(
        jax.devices(), steps, stacked=CALIBRATION_STACKED in references_of(name)
    )
    references = {ref: window for ref, (window, _) in windows.items()}

    def agree(settled):  # both processes must run the same windows
        return bool(multihost_utils.process_allgather(np.asarray(settled)).all())

    def start():  # a process that finished its copies first would time its wait in the next
        multihost_utils.sync_global_devices("window")

    timings = timed_between_references(runs, references, repeats, steps, agree, start)
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(timings), flush=True)


def process_timings(rounds: int, repeats: int, steps: int) -> dict[str, dict]:
    """{layout: its `timed_between_references` over all its launches on 2 processes x 2
    devices (windows and their references joined, faults the worst launch's)}, launches
    alternating per round."""
    out = {}
    for round_index in range(rounds):
        order = PROCESSES if round_index % 2 == 0 else PROCESSES[::-1]
        for strategy, mesh in order:
            command = [
                sys.executable, "-m", "jddp.runtime.launch", "--nproc=2", "--devices_per_proc=2",
                "--",
                sys.executable, "-m", "experiments.bench.planner", "--worker",
                json.dumps([strategy, mesh, repeats, steps]),
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True, timeout=900)
            lines = [ln for ln in result.stdout.splitlines() if ln.startswith("[0] RESULT ")]
            if not lines:
                raise RuntimeError(f"{strategy} {mesh} failed:\n{result.stdout[-3000:]}")
            for name, timing in json.loads(lines[-1].split(" ", 2)[2]).items():
                joined = out.setdefault(name, {"faults": 0.0, "rounds": [], "beside": {}})
                joined["faults"] = max(joined["faults"], timing["faults"])
                joined["rounds"] += timing["rounds"]
                for ref, seconds in timing["beside"].items():
                    joined["beside"].setdefault(ref, []).extend(seconds)
    return out


# ------------------------------------------------------------------------------- bytes
def byte_check() -> list[dict]:
    """Every layout of the tiny test GPT on 8 devices: modelled bytes vs the HLO's."""
    import jax

    from experiments.bench.planner_programs import compiled_text, tiny_workload
    from jddp.observe.hlo import bytes_by_axes, collective_ops
    from jddp.planner import collective, comm
    from jddp.planner.search import layouts_for

    w = tiny_workload(heads=8)
    layouts, _ = layouts_for(w, 8, 8, stages=False)  # pipelines: tests/test_planner_comm.py
    # auto on a tensor mesh adds reshards over parts of fsdp that no sub-mesh names (its bytes
    # are not modelled: jddp/planner/auto.py); its other meshes are checked as XLA:CPU lowers them.
    layouts = [lay for lay in layouts if not (lay.strategy == "auto" and lay.tensor > 1)]
    rows = []
    for layout in layouts:
        start = time.perf_counter()
        text, names, ids = compiled_text(layout, heads=8)
        hlo = bytes_by_axes(collective_ops(text), ids, names)
        model = collective.bytes_by_axes(
            comm.step_collectives(w, layout, partitioner_reduce_scatter=False)
        )
        rows.append(
            {
                "layout": layout.name,
                "hlo_bytes": sum(hlo.values()),
                "model_bytes": int(sum(model.values())),
                "equal_per_axis_and_kind": hlo == model,
                "model_over_hlo": sum(model.values()) / sum(hlo.values()),
                "compile_s": time.perf_counter() - start,
            }
        )
        print(rows[-1], flush=True)
    assert jax.device_count() == 8
    return rows


def traffic_check() -> list[dict]:
    """The bytes each layout's compiled step (and the calibration GPT's) reads and writes
    outside its matmuls and collectives (jddp/observe/hlo.py `memory_traffic`), against what the
    planner counts for it (jddp/planner/timing.py `memory_traffic`): the layouts without
    stages (a pipeline's timetable runs in conditional branches, which the reader leaves out),
    in one process on 8 devices and, as one process sees them, on 4."""
    import jax

    from experiments.calibrate.measure import gpt_copies_step
    from jddp.observe.hlo import memory_traffic
    from jddp.planner.layouts import Layout
    from jddp.planner.timing import memory_traffic as counted

    model, b, rows = workload(), batch(), []

    def row(name, devices, text, counted_bytes):
        compiled = memory_traffic(text)
        rows.append(
            {
                "layout": name,
                "devices": devices,
                "compiled_mib": compiled / 2**20,
                "counted_mib": counted_bytes / 2**20,
                "compiled_over_counted": compiled / counted_bytes,
            }
        )
        print(rows[-1], flush=True)

    for devices in (8, 4):
        copies = gpt_copies_step(jax.devices()[:devices])
        layout = Layout("ddp", data=devices)
        row(
            CALIBRATION_FLAT, devices, copies.compiled_text(), sum(counted(copies.workload, layout))
        )
        layouts = IN_PROCESS if devices == 8 else PROCESSES
        for strategy, mesh in [e for e in layouts if "stage:" not in (e[1] or "")]:
            trainer = make_trainer(strategy, mesh, jax.devices()[:devices])
            step = trainer.strategy.lower_train_step(
                trainer.abstract_state(b), trainer.strategy.abstract_batch(b)
            )
            traffic = sum(counted(model, layout_of(strategy, mesh, devices)))
            row(name_of(strategy, mesh), devices, step.compile().as_text(), traffic)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="launches per 2-process layout")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--no-processes", action="store_true")
    parser.add_argument("--bytes", action="store_true")
    parser.add_argument("--traffic", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*json.loads(args.worker))
        return
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from experiments.bench import common

    common.check_output_folder(args.out)

    if args.bytes:
        rows = byte_check()
        common.report(
            "planner_bytes",
            rows,
            {
                # jddp's own collectives are modelled op by op; auto's are XLA's choice, whose
                # small reshards the planner leaves out (jddp/planner/auto.py)
                "all_equal_but_auto": all(
                    r["equal_per_axis_and_kind"] for r in rows if not r["layout"].startswith("auto")
                ),
                "auto_model_over_hlo": [
                    round(r["model_over_hlo"], 3) for r in rows if r["layout"].startswith("auto")
                ],
            },
            args.out,
        )
        return

    if args.traffic:
        rows = traffic_check()
        ratios = [r["compiled_over_counted"] for r in rows]
        common.report("planner_traffic", rows, {"min": min(ratios), "max": max(ratios)}, args.out)
        return

    from experiments.calibrate.profile import calibrate
    from jddp.errors import JddpError
    from jddp.planner.devices import load_cpu_profile, save_cpu_profile
    from jddp.run import cli

    load = os.getloadavg()[0]
    profile_file = os.path.join(args.out, "cpu_profile.json")
    _, measurements = calibrate(profile_file)
    profile = load_cpu_profile(profile_file)
    start_efficiency = profile.efficiency
    windows = calibration_windows(jax.devices(), args.steps)
    references = {name: window for name, (window, _) in windows.items()}
    # The planner's view of the calibration GPT: the same rows on 8 devices or on 4.
    calibration = {name: workload for name, (_, workload) in windows.items()}
    # Every window's time is kept as soon as it is measured: a fit refused below (a step
    # shorter than its memory traffic) would otherwise lose half an hour of measurements.
    timings_file = os.path.join(args.out, "planner_timings.json")
    measured = in_process_timings(args.repeats, args.steps, references)
    common.write_json(timings_file, {"in_process": measured})
    launched = {}
    if not args.no_processes:
        launched = process_timings(args.rounds, args.repeats, args.steps)
        common.write_json(timings_file, {"in_process": measured, "processes": launched})
    try:
        rows, profile = _predictions(profile, calibration, measured, launched)
    except JddpError as e:
        cli.fail(f"{e} (every window's time is in {timings_file})")
    measurements["interleaved_gpt_step_seconds"] = [
        statistics.median(measured[n]["rounds"]) for n in calibration
    ]
    # The run's profile, from the medians; each prediction uses the calibration GPT's windows
    # just before and after its layout's instead.
    save_cpu_profile(profile, measurements, profile_file)
    common.report(
        "planner",
        rows,
        {
            "model": f"GPT {LAYERS}x{WIDTH}, {HEADS} heads, vocab {VOCAB}, seq {SEQ}",
            "global_batch": GLOBAL_BATCH,
            "matmul_gflops": profile.peak_flops / 1e9,
            "efficiency": profile.efficiency,
            "efficiency_at_calibration": start_efficiency,
            "calibration_page_faults_per_step": {n: measured[n]["faults"] for n in calibration},
            "calibration_rounds_ms": {n: ms(measured[n]["rounds"]) for n in calibration},
            "calibration_in_launches_ms": {
                n: ms(launched[n]["rounds"]) for n in calibration if n in launched
            },
            "calibration_in_launches_page_faults_per_step": {
                n: launched[n]["faults"] for n in calibration if n in launched
            },
            "load_average_start": load,
            "load_average_end": os.getloadavg()[0],
            "max_abs_error": max(abs(r["predicted_over_measured"] - 1) for r in rows),
        },
        args.out,
    )


def _predictions(profile, calibration: dict, measured: dict, launched: dict):
    """(a row per layout: measured against predicted, the run's profile): the profile's
    efficiency from the calibration GPT's median window; each row's from its neighbours."""
    from jddp.planner.timing import predict

    medians = {n: statistics.median(measured[n]["rounds"]) for n in calibration}
    profile = calibrated(profile, calibration, medians, 8)
    model = workload()
    rows = []
    layouts = [(s, m, "1 x 8", 8, 8, measured) for s, m in IN_PROCESS]
    layouts += [(s, m, "2 x 2", 4, 2, launched) for s, m in PROCESSES if launched]
    for strategy, mesh, processes, devices, per_host, timings in layouts:
        timing = timings[name_of(strategy, mesh)]
        beside_seconds = {
            ref: beside(timing["rounds"], seconds) for ref, seconds in timing["beside"].items()
        }
        beside_profile = calibrated(profile, calibration, beside_seconds, devices)
        p = predict(model, layout_of(strategy, mesh, devices), beside_profile, per_host)
        seconds = statistics.median(timing["rounds"])
        row = _row(name_of(strategy, mesh), processes, seconds, timing["faults"], p)
        rows.append(
            row
            | {
                "rounds_ms": ms(timing["rounds"]),
                "calibration_beside_ms": ms(timing["beside"][CALIBRATION_FLAT]),
                "efficiency": beside_profile.efficiency,
            }
        )
    return rows, profile


def steps_window(run, steps: int):
    """A window of `steps` calls of `run()`, returning its seconds."""

    def window() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            run()
        return time.perf_counter() - start

    return window


def beside(seconds: list, reference: list) -> float:
    """The reference's seconds as they stood beside `seconds`: the median of `seconds` over
    the median ratio of `seconds[i]` to `reference[i]`, the reference's time around window i
    (`common.between_references`). The machine's speed moves within seconds (the calibration
    GPT's windows spread by 1.2-1.4x); a ratio of neighbours cancels what moved."""
    from experiments.bench import common

    pair = {"layout": {"all_sec": seconds}, "reference": {"all_sec": reference}}
    return statistics.median(seconds) / common.paired_ratio(pair, "reference", "layout")


def calibrated(profile, calibration: dict, seconds: dict, devices: int):
    """`profile` with the efficiency (and, where `seconds` has the stacked one's, the
    stacked-layers slowdown) of the calibration GPT's step `seconds` ({name: seconds}) on
    `devices` devices (`calibration`: {name: its workload}). The machine's speed drifts within
    a run (a calibration timed once, before the layouts, can read an efficiency 20% off one
    timed an hour later), so a prediction is compared with a measurement at the rate the
    machine had while it was measured. Where the calibration GPT's matmuls ran faster than the
    matmul rate the calibration measured (up to half an hour before), that faster rate is the
    machine's (efficiency 1): a prediction depends only on the rate times the efficiency."""
    from experiments.calibrate.profile import efficiency_of

    def efficiency(name):
        return efficiency_of(
            seconds[name], calibration[name], devices, profile, allow_above_one=True
        )

    flat = efficiency(CALIBRATION_FLAT)
    fitted = dataclasses.replace(
        profile, peak_flops=profile.peak_flops * max(flat, 1.0), efficiency=min(flat, 1.0)
    )
    if CALIBRATION_STACKED not in seconds:
        return fitted
    slowdown = flat / efficiency(CALIBRATION_STACKED)
    return dataclasses.replace(fitted, stacked_layers_slowdown=slowdown)


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
