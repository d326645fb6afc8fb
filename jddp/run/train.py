"""`jddp-train`, the experiment command line (installed with jddp; also `python -m
jddp.run.train`, and `python -m experiments.train` in a checkout): one config trained with data
parallelism, into a workdir it resumes from. `--help` prints `USAGE`."""

import datetime
import functools
import os
import sys

from absl import app, flags, logging

from jddp.run.cli import ConfigFlag, exit_code, fail, fail_with, quiet_program

USAGE = """jddp-train: train an experiment config with data parallelism.

    jddp-train --config=path/to/config.py --workdir=runs/mine --config.global_batch_size=256

--config names a Python file whose get_config() returns an ml_collections.ConfigDict (start it
from jddp.run.config.default_config()); --config.KEY=VALUE overrides any key. Every key, its
default and meaning: docs/configs.md in jddp's documentation; the defaults, commented, are in
    {defaults}
Without --config it trains those defaults (an MLP on the UCI digits); example configs are in a
checkout's experiments/configs/. The config file's directory is importable, so
config.model = "my_models:Net" may name a module my_models.py beside it.

A user mistake (bad flag, config value, workdir) ends in one line on stderr and exit code 2;
what a later try may get past (the file system's refusal, a workdir a dying run still holds) in
one line and exit code 75; Ctrl-C in 130 (every code: docs/errors.md).
Several processes: start each with the same command under jddp-launch, srun, mpirun, a
Kubernetes Indexed Job or on every TPU VM worker, or pass the three process flags below.
"""

# The library's own defaults (jddp/run/config.py is a config file too): installed with jddp.
PACKAGED_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.py")

_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Directory for metrics, TensorBoard files and checkpoints "
    "(default: a new runs/CONFIG-TIMESTAMP).",
)
# Multi-process jobs: all three, or none (then from jddp-launch, SLURM, Open MPI, Kubernetes or
# a TPU pod's environment; with none of those, one process).
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, from 0.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_seconds",
    30,
    "A process silent this long is declared lost and the job stops (multi-process only).",
)
_PREEMPTED_EXIT_CODE = flags.DEFINE_integer(
    "preempted_exit_code",
    0,
    "Exit code of every process after a SIGTERM save (0: success). A scheduler that would take "
    "0 for the job's end, such as a Kubernetes Job, is told this way to start it again.",
    lower_bound=0,
    upper_bound=255,
)
_OWN_FLAGS = (
    _WORKDIR, _COORDINATOR, _NUM_PROCESSES, _PROCESS_ID, _HEARTBEAT, _PREEMPTED_EXIT_CODE,
)  # fmt: skip

# Without --config: the packaged defaults (`python -m experiments.train` passes its own flag).
CONFIG = ConfigFlag(PACKAGED_CONFIG)


def _default_workdir(config_path: str) -> str:
    name = os.path.splitext(os.path.basename(config_path))[0]
    if os.path.abspath(config_path) == PACKAGED_CONFIG:
        name = "default"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{name}-{stamp}")


def main(argv: list[str], config: ConfigFlag = CONFIG) -> None:
    """absl's main: trains the config `config` parsed (`config.parse`) into --workdir."""
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}; flags look like --config.KEY=VALUE")
    # Before JAX starts its threads: XLA:CPU's step buffers then reuse freed host memory
    # (jddp/runtime/host_memory.py). jddp's own entry points apply it; importing jddp does not.
    from jddp.runtime import host_memory

    host_memory.keep_freed_memory()
    import jax

    from jddp.errors import JddpError
    from jddp.observe import goodput
    from jddp.run.experiment import train_and_evaluate
    from jddp.runtime import processes as runtime
    from jddp.runtime import supervise

    workdir = _WORKDIR.value or _default_workdir(config.path)
    quiet_program()
    processes = {
        "coordinator_address": _COORDINATOR.value,
        "num_processes": _NUM_PROCESSES.value,
        "process_id": _PROCESS_ID.value,
    }
    try:
        launch = runtime.detect(**processes)
        if launch.source not in ("single", "jddp-launch") and not supervise.is_supervised():
            # A lost peer aborts a process in JAX's own words: a watcher says it in one line.
            command = [sys.executable, *sys.orig_argv[1:]]
            sys.exit(supervise.supervise(command, launch.num_processes))
        runtime.initialize(**processes, heartbeat_timeout_seconds=_HEARTBEAT.value)
        if jax.process_index() > 0:  # one voice in the log: process 0's
            logging.set_verbosity(logging.WARNING)
        # Goodput counts this process's whole life: its start, imports included.
        summary = train_and_evaluate(config.value, workdir, started_at=goodput.process_start_time())
    except (JddpError, OSError) as e:  # a mistake (2), or what a later try may get past (75)
        fail_with(e)
    except KeyboardInterrupt as e:  # Ctrl-C: jddp.fit saved at the end of the step, if it ran
        saved = f": {e}" if str(e) else ""
        print(f"interrupted{saved}; run the same command to resume", file=sys.stderr)
        sys.exit(exit_code(e))
    except jax.errors.JaxRuntimeError as e:
        supervise.await_lost_peer_verdict(e, _HEARTBEAT.value)
        raise
    if summary.get("preempted"):
        if jax.process_index() == 0:
            print(
                f"preempted: checkpoint saved at step {summary['step']}; run the same command "
                f"to resume; workdir {os.path.abspath(workdir)}"
            )
        sys.exit(_PREEMPTED_EXIT_CODE.value)
    if jax.process_index() > 0:
        return
    perplexity = summary.get("eval_perplexity")  # language models
    if summary.get("goodput"):
        print(goodput.summary_line(summary["goodput"]))
    print(
        f"done: eval accuracy {summary['eval_accuracy']:.4f}, "
        f"eval loss {summary['eval_loss']:.4f}, "
        + (f"perplexity {perplexity:.3f}, " if perplexity is not None else "")
        + f"wall time {summary['wall_time_sec']:.1f} s; workdir {os.path.abspath(workdir)}"
    )


def run(config: ConfigFlag = CONFIG) -> None:
    """The `jddp-train` command, with `config` as its --config flag (another program passes its
    own default config file this way): parses the command line (one line and exit code 2 for a
    mistake) and trains."""
    # absl's --help lists the main program's key flags: these, whichever script started it.
    for holder in _OWN_FLAGS:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[holder.name])
    app.run(functools.partial(main, config=config), flags_parser=functools.partial(_parse, config))


def _parse(config: ConfigFlag, argv: list[str]) -> list[str]:
    """`config.parse`, with USAGE as the text --help prints. absl prints the docstring of the
    `__main__` module, whichever script started the program (jddp-train's wrapper has none): it
    is lent USAGE for the parse, the only time --help is read, and given its own back."""
    main_module = sys.modules["__main__"]
    own = main_module.__doc__
    main_module.__doc__ = USAGE.format(defaults=PACKAGED_CONFIG)
    try:
        return config.parse(argv)
    finally:
        main_module.__doc__ = own


if __name__ == "__main__":
    run()
