"""What jddp adds to a training step on one device: `Trainer.step` and `jddp.fit`'s loop against
a hand-written `jax.jit` Flax + optax loop over the same model, batches and optimizer.

    python -m experiments.bench.step_overhead [--repeats 21] [--steps 100] [--instances 3]
        [--out bench_results]

MLP 784-1024-1024-10, Adam(1e-3), batch 256, float32, the first device, with jddp's default
metrics (loss and gradient norm; the hand-written step returns both). Every loop gets its batches
as a user's loop does: host (numpy) batches from an iterator, placed on the device each step (the
hand-written loop with `jax.device_put`, `Trainer.step` itself, `fit` through its prefetch), at
most 4 steps in flight, the metrics read at the end. A window is `--steps` steps; fit's are the
steps between its records at `--steps` and twice that, in one `fit` call. Each round runs every
window once, the order reversed every other round; a ratio is the median over rounds of the
hand-written loop's time over the other's in the same round (1.00: jddp costs nothing), and the
cost is the median of the per-step differences. On a shared 2-core machine one round's ratio
moves by up to 3%, and medians of 11 rounds moved by 0.7% from run to run: hence 21 rounds. Ratios
are given in wall time and in the process's CPU time (all its threads), which other jobs taking
the cores inflate far less. `jit, again` is a second hand-written loop: its ratio is what the
machine's noise alone gives.

Every loop runs as `--instances` copies, each with its own compiled program and state, and a
round's time for a loop is the mean of its copies': copies of one identical jit loop differ by
up to 1.1% for as long as they live, the same way round after round (four copies, 13 rounds:
the slowest slower than the first in 10), which a single copy would book as the loop's cost.

The same loops on a model too small to keep the device busy (MLP 784-8-8-10, batch 8, ten
times the steps) time what the host spends dispatching a step: their cost is jddp's host work
per step.
"""

import argparse
import collections
import itertools
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import optax

import jddp
from experiments.bench import common
from jddp.models import MLP
from jddp.trainer import MAX_STEPS_IN_FLIGHT, InFlightBound

INPUTS, CLASSES = 784, 10
SIZES = {"full": (1024, 256), "host": (8, 8)}  # (hidden width, batch)
DISTINCT_BATCHES = 4  # the host iterator cycles over these


def host_batch(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.normal(size=(rows, INPUTS)).astype(np.float32),
        "label": rng.integers(0, CLASSES, size=rows).astype(np.int32),
    }


def model(width: int) -> MLP:
    return MLP(num_classes=CLASSES, hidden_sizes=(width, width))


def jddp_trainer(width: int, batch, log_grad_norm: bool = True):
    trainer = jddp.Trainer(
        model(width),
        jddp.losses.softmax_cross_entropy,
        optax.adam(1e-3),
        devices=jax.devices()[:1],
        log_grad_norm=log_grad_norm,
    )
    return trainer, trainer.init(seed=0, sample_batch=batch)


def plain_step(width: int, batch, grad_norm: bool = False):
    """The hand-written step: value_and_grad, optax update, donated state; with `grad_norm` it
    also computes the gradient's global norm, as jddp's default metrics do. Returns (step,
    state); the step returns (state, {"loss", "grad_norm"?})."""
    net, tx = model(width), optax.adam(1e-3)
    params = jax.jit(net.init)(jax.random.key(0), batch["image"][:1])["params"]

    def train_step(state, batch):
        params, opt_state = state

        def loss_fn(params):
            logits = net.apply({"params": params}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {"loss": loss} | ({"grad_norm": optax.global_norm(grads)} if grad_norm else {})
        return (optax.apply_updates(params, updates), opt_state), metrics

    return jax.jit(train_step, donate_argnums=0), (params, tx.init(params))


def clocks() -> np.ndarray:
    """(wall, CPU) seconds: CPU time of every thread of this process, which other processes
    taking the cores do not inflate as they do the wall time."""
    return np.array([time.perf_counter(), time.process_time()])


def windows(width: int, rows: int, steps: int, cpu: dict[str, list]) -> dict:
    """{name: a timed window returning wall seconds per step, and appending CPU seconds per
    step to `cpu[name]`}: the hand-written loop (twice), a `Trainer.step` loop and `fit`, each
    carrying its own state on from window to window and drawing host batches from an iterator
    like the others'."""
    batches = [host_batch(rows, seed) for seed in range(DISTINCT_BATCHES)]
    device = jax.devices()[0]

    def per_step(name, start, end) -> float:
        wall, cpu_seconds = (end - start) / steps
        cpu[name].append(cpu_seconds)
        return wall

    def timed_loop(name, step, state, place, in_flight_limit):
        """A window of `steps` `step(state, place(batch))` calls, at most `in_flight_limit`
        outstanding (None: `step` bounds them)."""
        carried = [state]

        def run():
            state, in_flight = carried[0], InFlightBound(in_flight_limit)
            start = clocks()
            for batch in itertools.islice(itertools.cycle(batches), steps):
                state, metrics = step(state, place(batch))
                in_flight.add(metrics["loss"])
            jax.device_get(metrics)  # what fit's record reads
            carried[0] = jax.block_until_ready(state)
            return per_step(name, start, clocks())

        return run

    def put(batch):
        return jax.device_put(batch, device)

    def jit_loop(name):
        step, state = plain_step(width, batches[0], grad_norm=True)
        return timed_loop(name, step, state, put, MAX_STEPS_IN_FLIGHT)

    trainer, state = jddp_trainer(width, batches[0])
    fit_trainer, fit_state = jddp_trainer(width, batches[0])
    carried = [fit_state]

    def fit_window():
        marks = []
        with tempfile.TemporaryDirectory() as workdir:
            carried[0] = jddp.fit(
                fit_trainer,
                itertools.cycle(batches),
                workdir=workdir,
                num_steps=2 * steps,
                sample_batch=batches[0],
                state=carried[0],
                log_every=steps,
                checkpoint_every=0,
                hooks=[lambda step, state, record: marks.append(clocks())],
            )
        return per_step("fit", *marks)

    return {
        "jit": jit_loop("jit"),
        # `Trainer.step` places host batches itself, and bounds its steps in flight.
        "Trainer.step": timed_loop("Trainer.step", trainer.step, state, lambda b: b, None),
        "fit": fit_window,
        "jit, again": jit_loop("jit, again"),
    }


def compared(jit: list[float], loop: list[float]) -> dict:
    """Round by round (seconds per step): the median, least and greatest of jit / loop, and the
    median of loop - jit in microseconds."""
    ratios = [j / o for j, o in zip(jit, loop, strict=True)]
    costs = [(o - j) * 1e6 for j, o in zip(jit, loop, strict=True)]
    return {
        "ratio": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "cost_us": statistics.median(costs),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="rounds (see above)")
    parser.add_argument("--steps", type=int, default=100, help="steps per window (full model)")
    parser.add_argument("--instances", type=int, default=3, help="copies of every loop")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    common.check_counts(repeats=args.repeats, steps=args.steps, instances=args.instances)

    all_windows, cpu = {}, {size: collections.defaultdict(list) for size in SIZES}
    for size, (width, rows) in SIZES.items():
        steps = args.steps * (10 if size == "host" else 1)
        for copy in range(args.instances):
            for name, window in windows(width, rows, steps, cpu[size]).items():
                all_windows[(size, name, copy)] = window
    common.warm_up(all_windows)
    for size in SIZES:
        cpu[size].clear()  # from here, entries i*copies .. (i+1)*copies-1 are round i's
    timings = common.interleaved_medians(all_windows, args.repeats)

    def per_round(times: list[float]) -> list[float]:
        """Round by round, the mean over a loop's copies (`times` in the order they ran)."""
        return np.asarray(times).reshape(-1, args.instances).mean(axis=1).tolist()

    wall = {
        (size, name): np.mean(
            [timings[(size, name, c)]["all_sec"] for c in range(args.instances)], axis=0
        ).tolist()
        for (size, name, copy) in all_windows
        if copy == 0
    }
    rows = []
    for size in SIZES:
        jit, jit_cpu = wall[(size, "jit")], per_round(cpu[size]["jit"])
        for name in ("Trainer.step", "fit", "jit, again"):
            wall_time = compared(jit, wall[(size, name)])
            cpu_time = compared(jit_cpu, per_round(cpu[size][name]))
            rows.append(
                {
                    "model": size,
                    "loop": name,
                    "us_per_step": statistics.median(wall[(size, name)]) * 1e6,
                    "jit_us_per_step": statistics.median(jit) * 1e6,
                    "ratio_jit_over_loop": wall_time["ratio"],
                    "ratio_min": wall_time["min"],
                    "ratio_max": wall_time["max"],
                    "cost_us_per_step": wall_time["cost_us"],
                    "cpu_ratio": cpu_time["ratio"],
                    "cpu_cost_us_per_step": cpu_time["cost_us"],
                }
            )
    common.report(
        "step_overhead",
        rows,
        {
            "models": {
                size: f"MLP {INPUTS}-{w}-{w}-{CLASSES}, Adam, batch {r}"
                for size, (w, r) in SIZES.items()
            },
            "device": str(jax.devices()[0]),
            "repeats": args.repeats,
            "instances": args.instances,
            "steps_per_window": {"full": args.steps, "host": 10 * args.steps},
            "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
        },
        args.out,
    )


if __name__ == "__main__":
    main()
