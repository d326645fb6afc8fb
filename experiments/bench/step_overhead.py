"""What jddp adds to a training step on one device: `Trainer.step` and `jddp.fit`'s loop against a
hand-written `jax.jit` Flax + optax step over the same model, batch and optimizer.

    python -m experiments.bench.step_overhead [--repeats 11] [--steps 20] [--fit-steps 100]
        [--out bench_results]

MLP 784-1024-1024-10, Adam(1e-3), global batch 256, float32, the first device. Each jddp window
runs right between two windows of its hand-written reference (`common.between_references`);
the ratio is the median over rounds of reference time / jddp time (1.00: jddp costs nothing).

- `Trainer.step`: `--steps` steps on one device-resident batch, at most 4 in flight; with jddp's
  default metrics (loss and `grad_norm`) against the jit step that also computes the gradient's
  global norm (the same work) and the plain one (the loss alone), and with the loss alone
  (`log_grad_norm=False`) against the plain one.
- `jddp.fit`: its loop over host batches (placed each step, checkpoints off, one record per
  window), timed from the record at step `--fit-steps` to the one at twice that, against a loop
  that `jax.device_put`s each host batch and runs the jit step with the same metrics.
- host work: the same steps on a model too small to keep the device busy (MLP 784-8-8-10,
  batch 8), so a step's time is what the host spends dispatching it; the difference is jddp's
  host work per step, in microseconds.
"""

import argparse
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
SIZES = {"full": (1024, 256), "host": (8, 8)}  # (hidden width, global batch)


def host_batch(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
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


def window(step, state, batch, steps: int):
    """A timed window of `steps` calls of `step(state, batch) -> (state, metrics)` carrying the
    state on; it returns seconds per step."""
    carried = [state]

    def run():
        def loss_of(state, batch):
            state, metrics = step(state, batch)
            return state, metrics["loss"]

        carried[0], seconds = common.timed_steps(loss_of, carried[0], batch, steps)
        return seconds / steps

    return run


def step_windows(width: int, batch, steps: int) -> tuple[dict, dict, dict]:
    """(jddp windows, reference windows, {jddp window: its references}): `Trainer.step` with
    its default metrics against the jit step computing the same (loss and gradient norm) and
    the plain one (loss only), and with the loss alone against the plain one."""
    variants, references = {}, {}
    for name, log_grad_norm in (("default metrics", True), ("loss only", False)):
        trainer, state = jddp_trainer(width, batch, log_grad_norm)
        variants[name] = window(trainer.step, state, trainer.place_batch(batch), steps)
    placed = jax.device_put(batch, jax.devices()[0])
    for name, grad_norm in (("jit + grad norm", True), ("jit", False)):
        references[name] = window(*plain_step(width, batch, grad_norm), placed, steps)
    compared = {"default metrics": ("jit + grad norm", "jit"), "loss only": ("jit",)}
    return variants, references, compared


def fit_windows(batch, steps: int) -> tuple[dict, dict, dict]:
    """(jddp window, reference window, pairing): seconds per step of `jddp.fit` from its record
    at step `steps` to the one at 2 x `steps`, against a plain loop placing each host batch and
    running the jit step with the same metrics."""
    width = SIZES["full"][0]
    trainer, state = jddp_trainer(width, batch)
    carried = [state]

    def fit_window():
        marks = []
        with tempfile.TemporaryDirectory() as workdir:
            carried[0] = jddp.fit(
                trainer,
                itertools.repeat(batch),
                workdir=workdir,
                num_steps=2 * steps,
                sample_batch=batch,
                state=carried[0],
                log_every=steps,
                checkpoint_every=0,
                hooks=[lambda step, state, record: marks.append(time.perf_counter())],
            )
        return (marks[1] - marks[0]) / steps

    step, plain_state = plain_step(width, batch, grad_norm=True)
    plain = [plain_state]
    device = jax.devices()[0]

    def loop_window():
        state, in_flight = plain[0], InFlightBound(MAX_STEPS_IN_FLIGHT)
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, jax.device_put(batch, device))
            in_flight.add(metrics["loss"])
        jax.device_get(metrics)  # what fit's record reads
        plain[0] = jax.block_until_ready(state)
        return (time.perf_counter() - start) / steps

    return {"fit": fit_window}, {"jit loop": loop_window}, {"fit": ("jit loop",)}


def paired(timings: dict, name: str, reference: str) -> list[float]:
    """Each round's reference time (the mean of its windows either side) over `name`'s."""
    beside = timings[name]["beside"][reference]
    return [r / t for r, t in zip(beside, timings[name]["all_sec"], strict=True)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--steps", type=int, default=20, help="steps per Trainer.step window")
    parser.add_argument(
        "--fit-steps", type=int, default=100, help="timed steps per fit window (it runs twice that)"
    )
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)

    full, host = host_batch(SIZES["full"][1]), host_batch(SIZES["host"][1])
    variants, references, compared = {}, {}, {}
    parts = (
        ("Trainer.step", step_windows(SIZES["full"][0], full, args.steps)),
        ("jddp.fit", fit_windows(full, args.fit_steps)),
        ("host work", step_windows(SIZES["host"][0], host, 10 * args.steps)),
    )
    for part, (part_variants, part_references, part_compared) in parts:
        variants |= {f"{part}: {k}": w for k, w in part_variants.items()}
        references |= {f"{part}: {k}": w for k, w in part_references.items()}
        compared |= {
            f"{part}: {k}": tuple(f"{part}: {r}" for r in refs) for k, refs in part_compared.items()
        }
    common.warm_up({**variants, **references})
    timings = common.between_references(
        variants, references, lambda name: compared[name], args.repeats
    )

    rows, extra = [], {}
    for name, refs in compared.items():
        for reference in refs:
            ratios = paired(timings, name, reference)
            jddp_sec = timings[name]["median_sec"]
            reference_sec = timings[reference]["median_sec"]
            rows.append(
                {
                    "jddp": name,
                    "against": reference.split(": ")[1],
                    "jddp_us_per_step": jddp_sec * 1e6,
                    "reference_us_per_step": reference_sec * 1e6,
                    "ratio_reference_over_jddp": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
            )
            if name.startswith("host work"):
                key = f"host_us_per_step ({name.split(': ')[1]} vs {reference.split(': ')[1]})"
                extra[key] = (jddp_sec - reference_sec) * 1e6
    common.report(
        "step_overhead",
        rows,
        {
            **extra,
            "model": f"MLP {INPUTS}-1024-1024-{CLASSES}, Adam, batch {SIZES['full'][1]}",
            "device": str(jax.devices()[0]),
            "repeats": args.repeats,
            "steps_per_window": args.steps,
            "fit_steps_per_window": args.fit_steps,
            "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
        },
        args.out,
    )


if __name__ == "__main__":
    main()
