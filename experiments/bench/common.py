"""What every benchmark shares: interleaved timing with medians, the machine's matmul yardstick,
FLOP counts, and writing a table to stdout and JSON."""

import json
import os
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

from jddp.observe import device_peak
from jddp.runtime import host_memory
from jddp.runtime.fs import directory_problem
from jddp.runtime.host_memory import minor_faults
from jddp.trainer import MAX_STEPS_IN_FLIGHT, InFlightBound

# Benchmarks are jddp's own programs: they run with the host-memory settings its CLI applies
# (jddp/runtime/host_memory.py), before any JAX backend starts its threads.
host_memory.keep_freed_memory()

MATMUL_SIZE = device_peak.MATMUL_SIZE
# A window that takes fewer fresh pages from the OS than this (10 MiB of 4 KiB pages) runs
# on memory the process already holds: the steady state a long run reaches.
SETTLED_FAULTS = 2560
MAX_WARM_UP_ROUNDS = 8


def warm_up(windows: dict[str, Callable[[], float]], agree=all) -> int:
    """Runs every window (compiling it), then rounds of all of them until none takes fresh
    pages from the OS (`SETTLED_FAULTS`), at most `MAX_WARM_UP_ROUNDS`; returns the rounds
    run. A program whose buffers outgrow the heap pays page faults for several windows, not
    one (zero3 tensor:8 of the planner benchmark: ~195k faults and 2.2 s of system time a step
    at first, none by its fourth window), so a single warm-up window would time that transient.
    `agree([settled])` decides for all processes of a job (they must run the same windows)."""
    for round_index in range(1, MAX_WARM_UP_ROUNDS + 1):
        worst = 0
        for window in windows.values():
            before = minor_faults()
            window()
            worst = max(worst, minor_faults() - before)
        if round_index > 1 and agree([worst < SETTLED_FAULTS]):
            break
    return round_index


def interleaved_medians(variants: dict[str, Callable[[], float]], repeats: int) -> dict:
    """Runs each variant's timed window `repeats` times, reversing the order every round so drift
    on a noisy machine hits all variants alike. Each callable returns the seconds it measured.
    Returns {name: {"median_sec", "all_sec", "minor_faults"}}; `all_sec[i]` of every variant
    is from round i; `minor_faults`: the fresh pages its windows took, all rounds together."""
    times = {name: [] for name in variants}
    faults = dict.fromkeys(variants, 0)
    names = list(variants)
    for round_index in range(repeats):
        for name in names if round_index % 2 == 0 else names[::-1]:
            before = minor_faults()
            times[name].append(variants[name]())
            faults[name] += minor_faults() - before
    return {
        name: {"median_sec": statistics.median(t), "all_sec": t, "minor_faults": faults[name]}
        for name, t in times.items()
    }


def between_references(
    variants: dict[str, Callable[[], float]],
    references: dict[str, Callable[[], float]],
    references_of: Callable[[str], tuple[str, ...]],
    repeats: int,
) -> dict:
    """Runs each variant's timed window `repeats` times, each time right between windows of
    the references it is compared with (`references_of(name)`, names in `references`): a
    round runs the first variant's references, the variant, the references the variant still
    needs after it and the next variant needs before it, the next variant..., and closes with
    the last one's. A shared machine's speed moves within seconds: the ratio of two windows of
    one round up to 25 s apart spread 0.85-1.17, of windows back to back 0.94-1.04. Returns {name:
    {"median_sec", "all_sec", "minor_faults"}} for every variant and reference; a variant's
    also has "beside": {reference: [the mean of its windows just before and just after
    all_sec[i]]}."""
    timings = {name: {"all_sec": [], "minor_faults": 0} for name in (*variants, *references)}
    for name in variants:
        timings[name]["beside"] = {ref: [] for ref in references_of(name)}

    def timed(name: str, run) -> float:
        before = minor_faults()
        timings[name]["all_sec"].append(run())
        timings[name]["minor_faults"] += minor_faults() - before
        return timings[name]["all_sec"][-1]

    for _ in range(repeats):
        previous = None
        for name in [*variants, None]:
            owed = references_of(previous) if previous else ()  # the previous one's "after"
            wanted = references_of(name) if name else ()
            for ref in dict.fromkeys((*owed, *wanted)):
                seconds = timed(ref, references[ref])
                if ref in owed:
                    pairs = timings[previous]["beside"][ref]
                    pairs[-1] = (pairs[-1] + seconds) / 2
                if ref in wanted:
                    timings[name]["beside"][ref].append(seconds)
            if name is not None:
                timed(name, variants[name])
                previous = name
    for timing in timings.values():
        timing["median_sec"] = statistics.median(timing["all_sec"])
    return timings


def timed_steps(step, state, batch, steps: int):
    """Runs `state, loss = step(state, batch)` `steps` times with at most as many steps
    outstanding as jddp's Trainer allows; returns (state, seconds)."""
    in_flight = InFlightBound(MAX_STEPS_IN_FLIGHT)
    start = time.perf_counter()
    for _ in range(steps):
        state, loss = step(state, batch)
        in_flight.add(loss)
    jax.block_until_ready(state)
    return state, time.perf_counter() - start


def trainer_windows(runs: dict[str, list], steps: int) -> dict[str, Callable[[], float]]:
    """A timed window of `steps` `Trainer.step`s per entry of `runs` ({name: [trainer, state,
    placed batch]}); each window carries the state on (`runs[name][1]`)."""

    def window(name):
        def run():
            trainer, state, placed = runs[name]

            def step(state, batch):
                state, metrics = trainer.step(state, batch)
                return state, metrics["loss"]

            runs[name][1], seconds = timed_steps(step, state, placed, steps)
            return seconds

        return run

    return {name: window(name) for name in runs}


def paired_ratio(timings: dict, numerator: str, denominator: str) -> float:
    """Median over rounds of `denominator`'s time over `numerator`'s in the same round: the
    speed ratio numerator / denominator, robust to the machine drifting between rounds."""
    pairs = zip(timings[numerator]["all_sec"], timings[denominator]["all_sec"], strict=True)
    return statistics.median(d / n for n, d in pairs)


def matmul_window(device=None, count: int = 3) -> Callable[[], float]:
    """A timed window of `count` f32 `MATMUL_SIZE`^3 matmuls through XLA on `device`, compiled and
    warmed up. It returns seconds per matmul; the machine's rate is 2 MATMUL_SIZE^3 / that."""
    return device_peak.matmul_timer(device or jax.devices()[0], "float32", count)


def dense_train_flops(layer_sizes: list[int], batch: int) -> dict[str, int]:
    """FLOPs of one training step of a stack of dense layers, two ways.

    `model`: the MFU convention, 6 x weights x examples (forward 2, backward 4).
    `executed`: the matmuls XLA actually runs: `model` less the first layer's input gradient,
    which nothing needs.
    """
    pairs = list(zip(layer_sizes[:-1], layer_sizes[1:], strict=True))
    weights = sum(i * o for i, o in pairs)
    first_input_grad = 2 * batch * pairs[0][0] * pairs[0][1]
    return {"model": 6 * weights * batch, "executed": 6 * weights * batch - first_input_grad}


def token_batch(vocab: int, rows: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A language-model batch of random tokens: `inputs` and the next tokens as `targets`."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (rows, seq_len + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def check_output_folder(path: str) -> None:
    """Ends the benchmark in one line (exit code 2) if it could not write its results into
    `path`: checked before measuring, which takes minutes, not at the first write."""
    problem = directory_problem(path, write=True)
    if problem:
        _fail(f"--out {path!r} {problem}; pass a folder you can write to")


def check_counts(**counts: int) -> None:
    """Ends the benchmark in one line (exit code 2) on a count below 1 (`--repeats 0`): checked
    before measuring, not as a traceback once the rounds are over."""
    for flag, value in counts.items():
        if value < 1:
            _fail(f"--{flag} {value}: give a whole number of 1 or more")


def _fail(message: str) -> None:
    from jddp.run.cli import fail  # needs ml_collections, which gpu_mfu's GPU machine may lack

    fail(message)


def report(name: str, rows: list[dict], extra: dict, out_dir: str) -> str:
    """Prints `rows` as an aligned table and `extra` as lines; writes both to OUT_DIR/NAME.json."""
    columns = list(rows[0])
    cells = [[_fmt(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    for key, value in extra.items():
        print(f"{key}: {_fmt(value)}")
    path = write_json(
        os.path.join(out_dir, f"{name}.json"), {"rows": rows, **extra, "jax": jax.__version__}
    )
    print(f"wrote {path}")
    return path


def write_json(path: str, document) -> str:
    """Writes `document` to `path` (its folder made if missing); a failed write (a full disk, a
    folder changed while measuring) ends the benchmark in one line, exit code 2."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(document, f, indent=2)
    except OSError as e:
        _fail(f"cannot write {path}: {e.strerror}; what was measured so far is printed above")
    return path


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)
