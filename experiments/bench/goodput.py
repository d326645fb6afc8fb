"""Goodput of a real run with a failure: where the wall time of a short CLI training went, when
it is SIGKILLed once after a checkpoint and run again to the end.

    python -m experiments.bench.goodput [--steps 1000] [--kill_after 650] [--devices 2]

The digits MLP with two hidden layers of 1024 (1.1M parameters), global batch 256, a checkpoint
every 250 steps, a record every 10. The run is killed once it has logged `--kill_after` steps
and a checkpoint is committed, then the same command runs again at once and resumes from that
checkpoint. Prints each start's split and the run's (WORKDIR/goodput.json, jddp/observe/goodput.py),
writes them to OUT/goodput.json and draws the stacked split per start to `--picture`.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from experiments.bench import common
from jddp.observe import goodput
from jddp.run.cli import fail

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_SEC = 600  # any one training process is SIGKILLed past it
CHECKPOINT_EVERY = 250
# Left to right in the picture: before the loop, the loop's parts, then what was wasted.
ORDER = ("restart", "startup", "restore", "compile", "steps", "data", "eval", "save", "other")
ORDER += ("lost",)
COLORS = {
    "steps": "#2ca02c",
    "startup": "#9e9e9e",
    "restore": "#8c564b",
    "compile": "#1f77b4",
    "data": "#17becf",
    "eval": "#bcbd22",
    "save": "#9467bd",
    "other": "#c7c7c7",
    "lost": "#d62728",
    "restart": "#ff7f0e",
}


def train(workdir: str, args, log_name: str) -> subprocess.Popen:
    flags = [
        f"--workdir={workdir}",
        f"--config.num_train_steps={args.steps}",
        "--config.log_every=10",
        f"--config.checkpoint_every={CHECKPOINT_EVERY}",
        f"--config.eval_every={args.steps // 2}",
        "--config.warmup_steps=20",
        "--config.global_batch_size=256",
        "--config.model_args.hidden_sizes=(1024,1024)",
    ]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    with open(os.path.join(os.path.dirname(workdir), log_name), "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "experiments.train", *flags],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


def last_logged_step(workdir: str) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return max((json.loads(line)["step"] for line in f if line.endswith("\n")), default=0)


def has_checkpoint(workdir: str) -> bool:
    folder = os.path.join(workdir, "checkpoints")
    return os.path.isdir(folder) and any(name.isdigit() for name in os.listdir(folder))


def run_with_one_kill(workdir: str, args) -> None:
    """Trains, SIGKILLs the process after a checkpoint and `--kill_after` logged steps, and runs
    the same command again to the end."""
    process = train(workdir, args, "first.log")
    deadline = time.monotonic() + DEADLINE_SEC
    while not (has_checkpoint(workdir) and last_logged_step(workdir) >= args.kill_after):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            fail(f"the run ended before step {args.kill_after}; see {workdir}/../first.log")
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    print(f"killed at step {last_logged_step(workdir)}; running the same command again")
    rerun = train(workdir, args, "rerun.log")
    try:
        code = rerun.wait(timeout=DEADLINE_SEC)
    except subprocess.TimeoutExpired:
        rerun.kill()
        raise
    if code != 0:
        fail(f"the rerun exited with code {code}; see {workdir}/../rerun.log")


def rows_of(document: dict) -> list[dict]:
    """One row per start and one for the run: steps covered and seconds per category."""
    rows = []
    for index, start in enumerate(document["history"], 1):
        rows.append(
            {
                "start": str(index),
                "steps_from": start["first_step"],
                "steps_to": start["last_step"] + start["lost_steps"],  # as far as it got
                "lost_steps": start["lost_steps"],
                **{name: start["seconds"][name] for name in ORDER},
                "wall_sec": sum(start["seconds"].values()),
            }
        )
    rows.append(
        {
            "start": "run",
            "steps_from": 0,
            "steps_to": document["step"],
            "lost_steps": document["lost_steps"],
            **{name: document["seconds"][name] for name in ORDER},
            "wall_sec": document["wall_sec"],
        }
    )
    return rows


def plot(rows: list[dict], fraction: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"start {r['start']}\nsteps {r['steps_from']}-{r['steps_to']}"
        if r["start"] != "run"
        else "the run\n(all starts)"
        for r in rows
    ]
    figure, ax = plt.subplots(figsize=(9, 1.0 + 0.7 * len(rows)))
    for name in ORDER:
        left = [sum(r[n] for n in ORDER[: ORDER.index(name)]) for r in rows]
        ax.barh(labels, [r[name] for r in rows], left=left, color=COLORS[name], label=name)
    ax.invert_yaxis()
    ax.set_xlabel("seconds of wall time")
    ax.set_title(f"Where the wall time went: goodput {100 * fraction:.0f}% (killed once)")
    ax.legend(ncol=1, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kill_after", type=int, default=650, help="logged steps, then SIGKILL")
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--picture", default=os.path.join(REPO, "docs", "goodput.png"))
    args = parser.parse_args()
    if not CHECKPOINT_EVERY < args.kill_after < args.steps:
        fail(
            f"--kill_after must lie between the first checkpoint (step {CHECKPOINT_EVERY}) and "
            "--steps"
        )
    if args.devices < 1:
        fail("--devices must be at least 1")
    common.check_output_folder(args.out)
    common.check_output_folder(os.path.dirname(os.path.abspath(args.picture)))
    scratch = tempfile.mkdtemp(prefix="jddp-bench-goodput-")
    try:
        workdir = os.path.join(scratch, "run")
        run_with_one_kill(workdir, args)
        document = goodput.read(workdir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = rows_of(document)
    plot(rows, document["fraction"], args.picture)
    print(goodput.summary_line(document))
    common.report(
        "goodput",
        rows,
        {"fraction": document["fraction"], "steps": args.steps, "devices": args.devices},
        args.out,
    )
    print(f"wrote {args.picture}")


if __name__ == "__main__":
    main()
