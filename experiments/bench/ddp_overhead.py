"""What jddp's DDP step costs over a minimal hand-written `jax.pmap` step, and how close one
device's training step comes to the machine's matmul rate.

    python -m experiments.bench.ddp_overhead [--repeats 11] [--steps 10] [--out bench_results]

Every step trains an MLP 784-1024-1024-10 with Adam on one device-resident global batch of 256.
Part 1 (8 simulated CPU devices): jddp against hand-written pmap steps, timed windows interleaved
(the order reverses every round), medians compared; every loop keeps at most 4 steps in flight
(unbounded dispatch deadlocks XLA:CPU). Part 2 runs in a child process with one device: jddp's
step windows interleaved with 2048^3 matmul windows; achieved FLOP/s over the matmul rate, as
the median of each round's ratio.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

import jax
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jddp
from experiments.bench import common, step_overhead
from jddp.models import MLP

ONE_DEVICE_XLA_FLAGS = re.sub(
    r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
)
LAYERS = [784, 1024, 1024, 10]
GLOBAL_BATCH = 256


def synthetic_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "image": rng.normal(size=(GLOBAL_BATCH, LAYERS[0])).astype(np.float32),
        "label": rng.integers(0, 10, size=GLOBAL_BATCH).astype(np.int32),
    }


def model() -> MLP:
    return MLP(num_classes=LAYERS[-1], hidden_sizes=tuple(LAYERS[1:-1]))


def jddp_variant(devices, batch, log_grad_norm=False):
    trainer = jddp.Trainer(
        model(),
        jddp.losses.softmax_cross_entropy,
        optax.adam(1e-3),
        devices=devices,
        log_grad_norm=log_grad_norm,
    )
    state = trainer.init(seed=0, sample_batch=batch)
    placed = trainer.place_batch(batch)

    def step(state, batch):
        state, metrics = trainer.step(state, batch)
        return state, metrics["loss"]

    return step, state, placed


def handwritten_pmap_variant(devices, batch, stacked: bool):
    """The textbook pmap step: value_and_grad, pmean, apply_gradients. Nothing else.

    `stacked`: replicas stacked on a leading device axis (what `flax.jax_utils.replicate` makes
    and most pmap code uses); otherwise one replicated array per leaf with `in_axes=None`.
    """
    net = model()
    params = jax.jit(net.init)(jax.random.key(0), batch["image"][:1])["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-3))
    n = len(devices)
    mesh = Mesh(np.array(devices), ("batch",))
    per_device = NamedSharding(mesh, P("batch"))
    if stacked:
        state = jax.tree.map(
            lambda x: jax.device_put(np.broadcast_to(x, (n, *np.shape(x))), per_device), state
        )
    else:
        state = jax.device_put(state, NamedSharding(mesh, P()))
    placed = {
        k: jax.device_put(v.reshape(n, -1, *v.shape[1:]), per_device) for k, v in batch.items()
    }

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        grads, loss = jax.lax.pmean((grads, loss), "batch")
        return state.apply_gradients(grads=grads), loss

    state_axis = 0 if stacked else None
    step = jax.pmap(
        train_step,
        "batch",
        devices=devices,
        in_axes=(state_axis, 0),
        out_axes=(state_axis, None),
        donate_argnums=0,
    )
    return step, state, placed


def compare_with_handwritten(repeats: int, steps: int) -> tuple[list[dict], dict]:
    batch = synthetic_batch()
    devices = jax.devices()[:8]
    runs = {
        "jddp ddp": list(jddp_variant(devices, batch)),
        "jddp ddp + grad_norm metric": list(jddp_variant(devices, batch, log_grad_norm=True)),
        "hand-written pmap (stacked replicas)": list(
            handwritten_pmap_variant(devices, batch, stacked=True)
        ),
        "hand-written pmap (in_axes=None)": list(
            handwritten_pmap_variant(devices, batch, stacked=False)
        ),
    }

    def window(name):
        def run():
            step, state, placed = runs[name]
            runs[name][1], seconds = common.timed_steps(step, state, placed, steps)
            return seconds

        return run

    for name in runs:  # compile and warm up
        window(name)()
    timings = common.interleaved_medians({name: window(name) for name in runs}, repeats)
    rate = {name: GLOBAL_BATCH * steps / t["median_sec"] for name, t in timings.items()}
    rows = [
        {
            "variant": name,
            "devices": 8,
            "examples_per_sec": rate[name],
            "vs_jddp": common.paired_ratio(timings, name, "jddp ddp"),
        }
        for name in runs
    ]
    ratios = {
        "ratio_jddp_over_handwritten_stacked": common.paired_ratio(
            timings, "jddp ddp", "hand-written pmap (stacked replicas)"
        ),
        "ratio_jddp_over_handwritten_in_axes_none": common.paired_ratio(
            timings, "jddp ddp", "hand-written pmap (in_axes=None)"
        ),
    }
    return rows, ratios


def plain_jit_variant(batch):
    """The ceiling: a hand-written single-device `jax.jit` step with donated state (the one
    experiments/bench/step_overhead.py holds jddp's step against)."""
    jit_step, state = step_overhead.plain_step(LAYERS[1], batch)

    def step(state, batch):
        state, metrics = jit_step(state, batch)
        return state, metrics["loss"]

    return step, state, jax.device_put(batch)


def single_device_flops(repeats: int, steps: int) -> dict:
    """Achieved FLOP/s of one-device steps against the matmul yardstick, interleaved."""
    batch = synthetic_batch()
    runs = {
        "jddp": list(jddp_variant(jax.devices()[:1], batch)),
        "plain jit": list(plain_jit_variant(batch)),
    }

    def step_window(name):
        def run():
            step, state, placed = runs[name]
            runs[name][1], seconds = common.timed_steps(step, state, placed, steps)
            return seconds / steps

        return run

    windows = {name: step_window(name) for name in runs}
    for window in windows.values():
        window()
    windows["matmul"] = common.matmul_window(jax.devices()[0])
    timings = common.interleaved_medians(windows, repeats)
    flops = common.dense_train_flops(LAYERS, GLOBAL_BATCH)
    matmul_flops = 2 * common.MATMUL_SIZE**3
    matmul_sec = timings["matmul"]["all_sec"]
    figures = {"matmul_2048_gflops_per_sec": matmul_flops / timings["matmul"]["median_sec"] / 1e9}
    for name, prefix in (("jddp", "single_device"), ("plain jit", "plain_jit")):
        step_sec = timings[name]["median_sec"]
        paired = [  # each round's step rate over the same round's matmul rate
            (flops["model"] / s) / (matmul_flops / m)
            for s, m in zip(timings[name]["all_sec"], matmul_sec, strict=True)
        ]
        figures[f"{prefix}_step_ms"] = step_sec * 1e3
        figures[f"{prefix}_examples_per_sec"] = GLOBAL_BATCH / step_sec
        figures[f"{prefix}_fraction_of_matmul_rate"] = statistics.median(paired)
    figures["ratio_jddp_over_plain_jit_one_device"] = common.paired_ratio(
        timings, "jddp", "plain jit"
    )
    figures["fraction_convention"] = "6 x weights x examples (executed matmuls are 14.4% fewer)"
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed window")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--part", choices=["all", "single-device"], default="all")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    if args.part == "single-device":  # the child: print the figures as JSON for the parent
        print(json.dumps(single_device_flops(args.repeats, args.steps)))
        return

    # The child sees one device: simulated devices would share its cores.
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.bench.ddp_overhead",
            "--part=single-device",
            f"--repeats={args.repeats}",
            f"--steps={args.steps}",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "XLA_FLAGS": ONE_DEVICE_XLA_FLAGS},
    )
    single = json.loads(child.stdout.strip().splitlines()[-1])
    jax.config.update("jax_num_cpu_devices", 8)
    rows, ratios = compare_with_handwritten(args.repeats, args.steps)
    common.report(
        "ddp_overhead",
        rows,
        {**ratios, **single, "repeats": args.repeats, "steps_per_window": args.steps},
        args.out,
    )


if __name__ == "__main__":
    main()
