"""Whether the input pipeline ever makes the devices wait, and how fast the loader is on its own.

    python -m experiments.bench.input_pipeline [--repeats 11] [--steps 30] [--out bench_results]

Part 1 (8 simulated CPU devices): the `fashion_mnist_cnn` model and step, fed by the real
pipeline (grain loader reading Fashion-MNIST, device prefetch of 2) against the same step fed one
device-resident batch. Timed windows of `--steps` steps, each after 3 untimed steps (so a window
never starts on batches read ahead while the other variant ran), interleaved with the order
reversed every round; steps/s medians and the median of the per-round ratios (target >= 0.97).
Part 2: the loader alone, examples/s, for Fashion-MNIST and for CIFAR-sized images (50,000
random 32x32x3, the shape and path of the real cifar10 once decoded) with and without the CIFAR
crop and flip.
"""

import argparse
import time

import jax
import numpy as np

import jddp
from experiments.bench import common
from experiments.configs import fashion_mnist_cnn
from jddp import data, losses, models
from jddp.data import transforms
from jddp.run import optim

WARMUP_STEPS = 3  # untimed steps at the start of each window


def fashion_trainer(config):
    schedule = optim.learning_rate_schedule(config)
    return jddp.Trainer(
        models.create_model(config.model, 10, **config.model_args),
        losses.softmax_cross_entropy,
        optim.create_optimizer(config, schedule),
        metrics={"accuracy": losses.accuracy},
    )


def pipeline_against_resident_batch(dataset, repeats: int, steps: int, threads: int):
    config = fashion_mnist_cnn.get_config()
    trainer = fashion_trainer(config)
    state = {"state": trainer.init(config.seed, dataset.sample_batch())}
    loader = data.train_batches(
        dataset.train,
        dataset.transform,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        threads=threads,
    )
    placed = data.prefetch_to_device(loader, trainer.place_batch)
    resident = trainer.place_batch(next(loader))

    def window(next_batch):
        def run() -> float:
            current = state["state"]
            for _ in range(WARMUP_STEPS):
                current, _ = trainer.step(current, next_batch())
            jax.block_until_ready(current)
            start = time.perf_counter()
            for _ in range(steps):
                current, _ = trainer.step(current, next_batch())
            jax.block_until_ready(current)
            state["state"] = current
            return time.perf_counter() - start

        return run

    variants = {
        "real pipeline (grain + device prefetch)": window(lambda: next(placed)),
        "one device-resident batch": window(lambda: resident),
    }
    window(lambda: resident)()  # compile
    timings = common.interleaved_medians(variants, repeats)
    loader.close()
    names = list(variants)
    rows = [
        {
            "part 1: fashion_mnist_cnn, 8 devices": name,
            "steps/s": steps / timings[name]["median_sec"],
            "examples/s": steps * config.global_batch_size / timings[name]["median_sec"],
        }
        for name in names
    ]
    ratio = common.paired_ratio(timings, names[0], names[1])
    return rows, {"pipeline_over_resident_steps_per_sec": ratio, "target": 0.97}


def loader_alone(fashion, repeats: int, batches: int, threads: int):
    rng = np.random.default_rng(0)
    cifar_sized = data.ArraySource(
        {
            "image": rng.integers(0, 256, (50_000, 32, 32, 3), np.uint8),
            "label": rng.integers(0, 10, 50_000).astype(np.int32),
        }
    )
    mean, std = transforms.CIFAR_MEAN, transforms.CIFAR_STD
    cases = {
        "fashion_mnist, scale to [0, 1]": (fashion.train, fashion.transform),
        "CIFAR-sized, standardize": (
            cifar_sized,
            transforms.StandardizeImages(mean, std, augment=False),
        ),
        "CIFAR-sized, crop + flip + standardize": (
            cifar_sized,
            transforms.StandardizeImages(mean, std, augment=True),
        ),
    }
    batch_size = 128
    loaders = {
        name: data.train_batches(
            source, transform, global_batch_size=batch_size, seed=0, threads=threads
        )
        for name, (source, transform) in cases.items()
    }

    def window(loader):
        def run() -> float:
            next(loader)  # drain what was read ahead while other cases ran
            next(loader)
            start = time.perf_counter()
            for _ in range(batches):
                next(loader)
            return time.perf_counter() - start

        return run

    timings = common.interleaved_medians({n: window(it) for n, it in loaders.items()}, repeats)
    for loader in loaders.values():
        loader.close()
    return [
        {
            "part 2: loader alone, batches of 128": name,
            "examples/s": batches * batch_size / timings[name]["median_sec"],
        }
        for name in cases
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--steps", type=int, default=30, help="steps per timed window")
    parser.add_argument("--loader-batches", type=int, default=200, help="batches per window")
    parser.add_argument("--threads", type=int, default=1, help="loader threads (data.threads)")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    common.check_output_folder(args.out)
    jax.config.update("jax_num_cpu_devices", 8)
    fashion = data.open_dataset(data.get_dataset("fashion_mnist"))
    rows, ratios = pipeline_against_resident_batch(fashion, args.repeats, args.steps, args.threads)
    loader_rows = loader_alone(fashion, args.repeats, args.loader_batches, args.threads)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}")
    common.report(
        "input_pipeline",
        rows,
        {**ratios, "repeats": args.repeats, "steps_per_window": args.steps},
        args.out,
    )
    common.report(
        "input_pipeline_loader",
        loader_rows,
        {"repeats": args.repeats, "batches_per_window": args.loader_batches},
        args.out,
    )


if __name__ == "__main__":
    main()
