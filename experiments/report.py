"""Pictures (PNG, matplotlib: `pip install -e .[plots]`).

    python -m experiments.report --out DIR [--config=experiments/configs/gpt_1b.py]
        [--device=h100] [--devices_per_host=8] [--bench=bench_results] [--workdirs=a,b]

draws
    scaling.png      predicted MFU and tokens/s against device count (8 to 1,024) per strategy:
                     the best plan of each kind (ddp; zero1 / zero2 / zero3 on fsdp alone;
                     hybrid data x fsdp; with a tensor axis; with pipeline stages) that fits
    memory.png       bytes per device per strategy, against device count
    published.png    the published runs the planner reproduces: predicted against published
    bench.png        benchmark results from bench/*.json: the planner's predicted vs measured
                     step times, jddp against PyTorch DDP, and any other table's first numbers
    curves.png       loss and eval metrics of each workdir's metrics.jsonl, side by side
"""

import argparse
import dataclasses
import glob
import json
import os

KINDS = ("ddp", "zero1", "zero2", "zero3", "hybrid", "tensor", "pipeline")


def plan_kind(row: dict) -> str:
    mesh = row["mesh"]
    if mesh["stage"] > 1:
        return "pipeline"
    if mesh["tensor"] > 1:
        return "tensor"
    if row["strategy"] == "ddp":
        return "ddp"
    if mesh["data"] > 1:
        return "hybrid" if row["strategy"] == "zero3" else row["strategy"] + " hybrid"
    return row["strategy"]


def scaling(
    config, device: str, per_host: int, counts, batch_per_device: int = 0
) -> dict[str, dict[int, dict]]:
    """{kind: {devices: the best fitting row of that kind}} from the planner (no compiles);
    with `batch_per_device` the global batch grows with the devices (weak scaling)."""
    from jddp.errors import ConfigError
    from jddp.planner import search
    from jddp.planner.devices import get_profile
    from jddp.planner.workload import from_config

    profile = get_profile(device)
    workload = from_config(config)
    best: dict[str, dict[int, dict]] = {}
    for n in counts:
        if batch_per_device:
            workload = dataclasses.replace(
                workload,
                global_batch=batch_per_device * n,
                model_flops=workload.model_flops * batch_per_device * n / workload.global_batch,
            )
        try:
            rows, _ = search.plan(workload, n, profile, min(per_host, n))
        except ConfigError:
            continue  # this many devices do not split the batch
        for row in rows:
            kind = plan_kind(row)
            if row["fits"] and kind in KINDS and n not in best.setdefault(kind, {}):
                best[kind][n] = row  # rows come fastest first
    return best


def load_config(path: str):
    """`get_config()` of an experiment config file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("experiment_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        from jddp.errors import ConfigError

        raise ConfigError(
            f"config file {path!r} defines no get_config(); pass an experiment config"
        )
    return module.get_config()


def _axes(plt, rows=1, cols=1, width=6.0, height=4.0):
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    return fig, axes.ravel()


def draw_scaling(plt, best, title: str, out: str) -> list[str]:
    fig, (mfu, tokens) = _axes(plt, 1, 2)
    for kind, by_count in best.items():
        counts = sorted(by_count)
        mfu.plot(counts, [100 * by_count[n]["predicted_mfu"] for n in counts], "o-", label=kind)
        rate = [by_count[n]["predicted_tokens_per_s"] for n in counts]
        tokens.plot(counts, rate, "o-", label=kind)
    for ax, label in ((mfu, "predicted MFU (%)"), (tokens, "predicted tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    tokens.set_yscale("log")
    mfu.legend(fontsize=8)
    fig.suptitle(title)
    path = os.path.join(out, "scaling.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig, (ax,) = _axes(plt)
    for kind, by_count in best.items():
        counts = sorted(by_count)
        ax.plot(counts, [by_count[n]["bytes_per_device"] / 2**30 for n in counts], "o-", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("GiB per device (fastest plan that fits)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    memory = os.path.join(out, "memory.png")
    fig.tight_layout()
    fig.savefig(memory, dpi=110)
    return [path, memory]


def draw_published(plt, out: str) -> str:
    from jddp.planner.published import RUNS, predicted_utilization

    fig, (ax,) = _axes(plt, width=6.5, height=5.0)
    for run in RUNS:
        predicted = 100 * predicted_utilization(run)["predicted_mfu"]
        marker = "s" if run.calibration else "o"
        ax.plot(100 * run.published, predicted, marker, label=run.name)
    ax.plot([30, 70], [30, 70], "k-", lw=0.8)
    ax.fill_between([30, 70], [30 * 0.85, 70 * 0.85], [30 * 1.15, 70 * 1.15], alpha=0.12)
    ax.set_xlabel("published utilization (%)")
    ax.set_ylabel("predicted (%)")
    ax.set_title("published runs: predicted vs published (band: +-15%; squares: calibration)")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    path = os.path.join(out, "published.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _numbers(row: dict) -> list[tuple[str, float]]:
    return [
        (k, v) for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)
    ]


def bench_tables(bench_dir: str) -> dict[str, list[dict]]:
    """{name: rows} of every benchmark JSON in `bench_dir` that holds a table."""
    tables = {}
    for path in sorted(glob.glob(os.path.join(bench_dir, "*.json"))):
        document = _json(path, whole=True)
        if isinstance(document, dict) and document.get("rows"):
            tables[os.path.basename(path)[:-5]] = document["rows"]
    return tables


def draw_bench(plt, tables: dict[str, list[dict]], out: str) -> str | None:
    if not tables:
        return None
    fig, axes = _axes(plt, len(tables), 1, width=9.0, height=3.2)
    for ax, (name, rows) in zip(axes, tables.items(), strict=True):
        labels = [" ".join(str(v) for v in list(r.values())[:2]) for r in rows]
        if name == "planner":
            keys = ["measured_ms", "predicted_ms"]
        else:
            keys = [k for k, _ in _numbers(rows[0])][:2]
        width = 0.8 / max(1, len(keys))
        for i, key in enumerate(keys):
            xs = [j + i * width for j in range(len(rows))]
            ax.bar(xs, [float(r.get(key, 0) or 0) for r in rows], width, label=key)
        ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(rows))])
        ax.set_xticklabels(labels, rotation=20, fontsize=7, ha="right")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    path = os.path.join(out, "bench.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def read_metrics(workdir: str) -> list[dict]:
    return _json(os.path.join(workdir, "metrics.jsonl"), whole=False)


def _json(path: str, whole: bool):
    """A JSON file's document (`whole`) or a JSON-lines file's records; a ValueError naming
    the file if it is not JSON."""
    with open(path) as f:
        try:
            return json.load(f) if whole else [json.loads(line) for line in f if line.strip()]
        except ValueError as e:
            raise ValueError(f"{path} is not JSON ({e})") from None


def draw_curves(plt, runs: dict[str, list[dict]], out: str) -> str:
    fig, (loss, evals) = _axes(plt, 1, 2)
    for workdir, records in runs.items():
        name = os.path.basename(os.path.normpath(workdir))
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        if train:
            loss.plot(*zip(*train, strict=True), label=name)
        for key in sorted({k for r in records for k in r if k.startswith("eval_")}):
            points = [(r["step"], r[key]) for r in records if key in r]
            evals.plot(*zip(*points, strict=True), "o-", label=f"{name} {key}")
    loss.set_ylabel("training loss")
    evals.set_ylabel("eval metrics")
    for ax in (loss, evals):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    path = os.path.join(out, "curves.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="experiments/configs/gpt_1b.py")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--devices_per_host", type=int, default=8)
    parser.add_argument("--max_devices", type=int, default=1024)
    parser.add_argument(
        "--batch_per_device", type=int, default=0, help="weak scaling (0: the config's batch)"
    )
    parser.add_argument("--bench", default="bench_results")
    parser.add_argument("--workdirs", default="", help="comma-separated workdirs")
    parser.add_argument("--no_published", action="store_true")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        parser.exit(2, "error: matplotlib is not installed; pip install -e .[plots]\n")
    # Everything is read before the first picture is written: a mistake costs nothing.
    config, best, tables, runs = _read_inputs(parser, args)
    os.makedirs(args.out, exist_ok=True)
    batch = (
        f"{args.batch_per_device} sequences per device"
        if args.batch_per_device
        else f"global batch {config.global_batch_size}"
    )
    title = (
        f"{os.path.basename(args.config)}, {batch}: {args.device}, {args.devices_per_host} per host"
    )
    written = draw_scaling(plt, best, title, args.out)
    if not args.no_published:
        written.append(draw_published(plt, args.out))
    if tables:
        written.append(draw_bench(plt, tables, args.out))
    if runs:
        written.append(draw_curves(plt, runs, args.out))
    for path in written:
        print(f"wrote {path}")
    return written


def _read_inputs(parser, args):
    """(the config, its best plans by kind and device count, the benchmark tables, each
    workdir's metrics), or one line and exit code 2 naming what is wrong."""
    from jddp.errors import JddpError
    from jddp.runtime.fs import directory_problem

    if problem := directory_problem(args.out, write=True):
        parser.exit(2, f"error: --out {args.out!r} {problem}; pass a folder you can write to\n")
    workdirs = [w for w in args.workdirs.split(",") if w]
    for workdir in workdirs:
        if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
            parser.exit(2, f"error: {workdir!r} has no metrics.jsonl; pass a run's workdir\n")
    if not os.path.isfile(args.config):
        parser.exit(
            2,
            f"error: --config {args.config!r} is not a file; pass an experiment "
            "config such as experiments/configs/gpt_1b.py\n",
        )
    counts = [2**k for k in range(3, 11) if 2**k <= args.max_devices]
    try:
        config = load_config(args.config)
        best = scaling(config, args.device, args.devices_per_host, counts, args.batch_per_device)
    except JddpError as e:
        parser.exit(2, f"error: {e}\n")
    try:
        tables = bench_tables(args.bench)
        runs = {workdir: read_metrics(workdir) for workdir in workdirs}
    except (OSError, ValueError) as e:  # unreadable, or not JSON
        parser.exit(2, f"error: {e}; --bench and --workdirs take jddp's outputs\n")
    return config, best, tables, runs


if __name__ == "__main__":
    main()
