"""Pipeline parallelism: step time and memory of GPipe and 1F1B against the micro-batch count,
the bubble each implies, and what scan_layers saves in compile time.

    python -m experiments.bench.pipeline [--repeats 3] [--steps 2] [--out bench_results]
        [--parts simulated,cores,interleaved,compile]

- `simulated`: a GPT of 8 layers x 256 on 8 simulated devices, stage:4,data:2 under each
  schedule and M in {4, 8, 16}, against the model on data:2,fsdp:4 (no stage axis; blocks
  one by one, and as one scan): step time (interleaved medians), compiled peak and state per
  device, the timetable's bubble. The 8 devices share 2 cores, so an idle stage frees a core
  for the others: the bubble does not show in wall time here (it would on real devices), only
  the extra work of the pipeline.
- `cores`: 2 devices with one core each (XLA's intra-op threading off), a GPT of 4 layers,
  stage:2 against ddp on the same 2 devices, M in {2, 4, 8}: here a stage that idles leaves its
  core idle, so the slowdown can be held against the bubble formula's (M + S - 1) / M. The
  formula compares a pipeline with the same work done without bubbles, so `vs_formula` is the
  slowdown against ddp in M / 2 accumulation steps (each device's micro-batches the size of the
  pipeline's: smaller ones run faster per row here) over the formula's; `plain_vs_formula` the
  same against plain ddp. Both run their blocks one by one, as the stages do.
- `interleaved`: the same 2 devices, a GPT of 8 layers (2 per layer group: the backward in two
  ticks), stage:2 with repeats 1 and 2 (1F1B, M in {2, 4, 8}; GPipe's circular form at M = 4)
  against the same references: the slowdown held against the interleaved bubble formula's
  (V M + S - 1) / (V M). At V = 2, M = 4 both schedules also with `remat=none` (every
  intermediate stashed) against the default `dots`.
- `compile`: gpt_124m's train step compiled on one device with its 12 blocks one by one and as
  one scan (scan_layers).
Writes bench_results/pipeline.json and bench_results/pipeline.png (step time and peak memory
against M; needs matplotlib).
"""

import argparse
import json
import os
import subprocess
import sys
import time

from jddp.run.cli import fail

CORES_FLAGS = "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false"
PARTS = ("simulated", "cores", "interleaved", "compile")


def gpt_trainer(
    layers,
    width,
    mesh,
    strategy,
    schedule=None,
    microbatches=0,
    devices=None,
    scan=False,
    repeats=1,
    accumulation=1,
    remat="dots",
):
    import jax
    import optax

    import jddp
    from jddp.models import GPT
    from jddp.parallel.pipeline.options import PipelineOptions
    from jddp.run.objectives import OBJECTIVES

    objective = OBJECTIVES["language_model"]
    staged = mesh is not None and "stage" in mesh
    pipeline = PipelineOptions(microbatches, schedule, repeats, remat) if staged else None
    model = GPT(
        512,
        num_layers=layers,
        num_heads=4,
        embed_dim=width,
        max_seq_len=64,
        scan_layers=staged or scan,
    )
    return jddp.Trainer(
        model,
        objective.loss_fn,
        optax.adamw(1e-3),
        input_key="inputs",
        strategy=strategy,
        mesh=mesh,
        pipeline=pipeline,
        devices=devices or jax.devices(),
        log_grad_norm=False,
        grad_accum_steps=accumulation,
    )


def measure(variants, batch, repeats, steps):
    """Rows of memory and interleaved step times for {name: trainer}."""
    from experiments.bench import common

    runs, rows = {}, {}
    for name, trainer in variants.items():
        state = trainer.init(seed=0, sample_batch=batch)
        placed = trainer.place_batch(batch)
        memory = trainer.memory_report(state, placed)
        runs[name] = [trainer, state, placed]
        rows[name] = {
            "variant": name,
            "state_MiB": memory["state_bytes_per_device"] / 2**20,
            "peak_MiB": memory["peak_bytes_per_device"] / 2**20,
        }
    windows = common.trainer_windows(runs, steps)
    common.warm_up(windows)
    timings = common.interleaved_medians(windows, repeats)
    return rows, timings


def pipeline_rows(variants, rows, timings, plain, matched, steps):
    """Rows with each variant's slowdown against `plain` (the model without a stage axis) and
    that over the bubble formula's (`plain_vs_formula`), its slowdown against `matched[M]` (the
    same model run in micro-batches of the pipeline's size) and that over the formula's
    (`vs_formula`)."""
    from experiments.bench import common

    out = []
    for name, trainer in variants.items():
        row = rows[name] | {"step_s": timings[name]["median_sec"] / steps}
        if name != plain:
            row["measured_slowdown"] = common.paired_ratio(timings, plain, name)
        pipeline = trainer.strategy.pipeline
        if pipeline:
            bubble = pipeline.schedule.bubble(pipeline.layers_per_chunk)
            same = common.paired_ratio(timings, matched[pipeline.schedule.microbatches], name)
            row |= {
                "schedule": pipeline.schedule.name,
                "M": pipeline.schedule.microbatches,
                "repeats": pipeline.schedule.repeats,
                "remat": pipeline.remat,
                "bubble": bubble,
                "predicted_slowdown": 1 / (1 - bubble),
                "plain_vs_formula": row["measured_slowdown"] * (1 - bubble),
                "slowdown_same_microbatches": same,
                "vs_formula": same * (1 - bubble),
            }
        out.append(row)
    return out


def simulated(repeats, steps):
    import jax
    import numpy as np

    jax.config.update("jax_num_cpu_devices", 8)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (64, 65)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    plain = "no stage: data:2,fsdp:4"
    variants = {
        plain: gpt_trainer(8, 256, "data:2,fsdp:4", "zero1"),
        "no stage, blocks as one scan": gpt_trainer(8, 256, "data:2,fsdp:4", "zero1", scan=True),
    }
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8, 16):
            variants[f"{schedule} M={m}"] = gpt_trainer(
                8, 256, "stage:4,data:2", "zero1", schedule, m
            )
    rows, timings = measure(variants, batch, repeats, steps)
    # No reference in the pipelines' micro-batches here: the bubble does not show in wall time
    # on 8 devices sharing 2 cores, so every column compares with the plain model.
    return pipeline_rows(variants, rows, timings, plain, dict.fromkeys((4, 8, 16), plain), steps)


def two_core_references(layers, microbatch_counts):
    """{M: (name, trainer)}: the model without a stage axis on the 2 devices (ddp, blocks one by
    one) in M / 2 accumulation steps, so that each device runs micro-batches of the size a
    pipeline of M micro-batches runs: on this CPU a step in smaller micro-batches runs faster
    (in 4 accumulation steps, 0.77-0.82 of plain ddp's time), which is not the pipeline's
    doing."""
    return {
        m: (
            "ddp" if m == 2 else f"ddp, {m // 2} accumulation steps",
            gpt_trainer(layers, 256, None, "ddp", accumulation=m // 2),
        )
        for m in sorted(set(microbatch_counts))
    }


def two_core_rows(layers, pipelines, repeats, steps):
    """`pipelines` ({name: (M, trainer on stage:2 in M micro-batches)}) measured against
    `two_core_references`, on a global batch of 32 sequences of 64 tokens."""
    import jax
    import numpy as np

    assert jax.device_count() == 2
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (32, 65)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    references = two_core_references(layers, [2, *(m for m, _ in pipelines.values())])
    variants = dict(references.values()) | {name: t for name, (_, t) in pipelines.items()}
    rows, timings = measure(variants, batch, repeats, steps)
    matched = {m: name for m, (name, _) in references.items()}
    return pipeline_rows(variants, rows, timings, matched[2], matched, steps)


def cores(repeats, steps):
    pipelines = {
        f"{schedule} M={m}": (m, gpt_trainer(4, 256, "stage:2", "zero1", schedule, m))
        for schedule in ("gpipe", "1f1b")
        for m in (2, 4, 8)
    }
    return two_core_rows(4, pipelines, repeats, steps)


def interleaved(repeats, steps):
    pipelines = {
        f"{schedule} v={v} M={m}" + (f" remat={remat}" if remat != "dots" else ""): (
            m,
            gpt_trainer(8, 256, "stage:2", "zero1", schedule, m, repeats=v, remat=remat),
        )
        for v, schedule, m, remat in [
            (1, "1f1b", 4, "dots"),
            (2, "1f1b", 2, "dots"),
            (2, "1f1b", 4, "dots"),
            (2, "1f1b", 8, "dots"),
            (2, "gpipe", 4, "dots"),
            (2, "1f1b", 4, "none"),  # the stash holding everything: what remat=dots saves
            (2, "gpipe", 4, "none"),
        ]
    }
    return two_core_rows(8, pipelines, repeats, steps)


def compile_times():
    import jax
    import numpy as np

    from experiments.configs import gpt_124m
    from jddp import data
    from jddp.run import optim
    from jddp.run.factory import build_trainer

    rows = []
    for scan in (False, True):
        config = gpt_124m.get_config()
        config.model_args.scan_layers = scan
        config.compute_dtype = "float32"
        config.global_batch_size, config.data.seq_len = 1, 1024
        dataset = data.get_dataset(config.dataset)  # its spec only: nothing is read
        trainer = build_trainer(config, dataset, optim.learning_rate_schedule(config))
        batch = {k: np.zeros((1, 1024), np.int32) for k in ("inputs", "targets")}
        state = trainer.abstract_state(batch)
        start = time.perf_counter()
        lowered = trainer.strategy.lower_train_step(state, trainer.strategy.abstract_batch(batch))
        lowered.compile()
        rows.append(
            {
                "layers": "one scan" if scan else "one by one",
                "compile_s": time.perf_counter() - start,
            }
        )
    assert jax.device_count() >= 1
    return rows


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no picture")
        return
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for schedule in ("gpipe", "1f1b"):
        mine = [r for r in rows if r.get("schedule") == schedule]
        ms = [r["M"] for r in mine]
        line = time_axis.plot(
            ms, [r["slowdown_same_microbatches"] for r in mine], "o-", label=schedule
        )[0]
        time_axis.plot(
            ms,
            [r["measured_slowdown"] for r in mine],
            "o:",
            color=line.get_color(),
            alpha=0.5,
            label=f"{schedule} vs plain ddp",
        )
        memory_axis.plot(ms, [r["peak_MiB"] for r in mine], "o-", label=schedule)
    predicted = [r for r in rows if r.get("schedule") == "gpipe"]
    time_axis.plot(
        [r["M"] for r in predicted],
        [r["predicted_slowdown"] for r in predicted],
        "k--",
        label="bubble formula",
    )
    time_axis.set(
        xlabel="micro-batches M",
        ylabel="step time / ddp, same micro-batches",
        title="2 devices, one core each",
    )
    memory_axis.set(
        xlabel="micro-batches M", ylabel="compiled peak per device (MiB)", title="peak memory"
    )
    for axis in (time_axis, memory_axis):
        axis.set_xscale("log", base=2)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed window")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--child", choices=["cores", "interleaved"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        fail(f"--parts names {','.join(unknown)}; choose from {','.join(PARTS)}")
    if args.repeats < 1 or args.steps < 1:
        fail(f"--repeats {args.repeats} --steps {args.steps}: both must be at least 1")
    if args.child:  # a process of its own: 2 devices, one core each
        part = {"cores": cores, "interleaved": interleaved}[args.child]
        print(json.dumps(part(args.repeats, args.steps)))
        return
    from experiments.bench import common

    common.check_output_folder(args.out)

    result = {}
    for part in ("cores", "interleaved"):
        if part not in parts:
            continue
        child = subprocess.run(
            [
                sys.executable,
                "-m",
                "experiments.bench.pipeline",
                f"--child={part}",
                f"--repeats={args.repeats}",
                f"--steps={args.steps}",
            ],
            env={**os.environ, "XLA_FLAGS": CORES_FLAGS, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            check=True,
        )
        result[part] = json.loads(child.stdout.strip().splitlines()[-1])
    if "simulated" in parts:
        result["simulated"] = simulated(args.repeats, args.steps)
    if "compile" in parts:
        result["compile"] = compile_times()
    rows = [dict(part=part, **row) for part, part_rows in result.items() for row in part_rows]
    columns = sorted(
        {k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99
    )
    rows = [{c: r.get(c, "") for c in columns} for r in rows]
    common.report("pipeline", rows, {"repeats": args.repeats, "steps": args.steps}, args.out)
    if "cores" in result:
        plot(result["cores"], os.path.join(args.out, "pipeline.png"))


if __name__ == "__main__":
    main()
