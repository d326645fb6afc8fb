"""Several jddp command lines run one after another in one Python process, each with its own exit
code, stdout and stderr, for tests whose claim is what each command does rather than that it
starts a process: a process's imports cost ~3 CPU-s here, more than a small command's work.

`run_commands` (called by a test) starts `python -m tests.commands_in_one_process` once for a
list of commands; that process calls each module's entry point as its `python -m MODULE` line
would, with `sys.argv` set and absl's flags back at their defaults, and writes one JSON line per
command. Other tests start each command in its own process (tests/test_train_command.py,
test_launch_contract.py): those prove the process boundary.
"""

import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback


def run_commands(
    commands: list[list[str]], cwd=None, env=None, timeout: float = 600
) -> list[subprocess.CompletedProcess]:
    """Each command (`[MODULE, *ARGS]`, as `python -m MODULE ARGS` runs it) in one child process
    in `cwd` (the checkout by default), with `checkout_env(**env)`; killed after `timeout` seconds
    for all of them. One result per command, in order, as `subprocess.run` would give it."""
    from tests.helpers import REPO, checkout_env  # the child imports no more than it runs

    with tempfile.TemporaryDirectory() as folder:
        given, written = os.path.join(folder, "commands.json"), os.path.join(folder, "results")
        with open(given, "w") as f:
            json.dump(commands, f)
        child = subprocess.run(
            [sys.executable, "-m", __name__, given, written],
            cwd=cwd or REPO,
            env=checkout_env(**(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        results = []
        if os.path.exists(written):
            with open(written) as f:
                results = [json.loads(line) for line in f]
    assert child.returncode == 0 and len(results) == len(commands), (
        f"the commands' process ended with exit {child.returncode} after {len(results)} of "
        f"{len(commands)} commands:\n{child.stdout[-2000:]}\n{child.stderr[-3000:]}"
    )
    return [
        subprocess.CompletedProcess(command, r["exit"], r["stdout"], r["stderr"])
        for command, r in zip(commands, results, strict=True)
    ]


def _entry_point(module: str):
    """What `python -m MODULE` calls (each module's `if __name__ == "__main__":` block)."""
    if module == "jddp.plan":
        from absl import app

        from jddp import plan

        return lambda: app.run(plan.main, flags_parser=plan.CONFIG.parse)
    entry = {"experiments.train": "run", "jddp.run.train": "run", "jddp.run.export": "main"}
    return getattr(importlib.import_module(module), entry[module])


def _flags_at_defaults() -> None:
    """absl's flags as a fresh process has them: the config file flag and its `--config.KEY`
    overrides are defined anew by each command's parse, every other flag is unparsed."""
    from absl import flags

    for name in [n for n in flags.FLAGS if n == "config" or n.startswith("config.")]:
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
    # ml_collections loads every config file as the module `config_config`, executing it in the
    # namespace an earlier file left in sys.modules: a file without get_config() would find one.
    sys.modules.pop("config_config", None)


def _exit_code(entry) -> int:
    """`entry()`'s exit status as the interpreter would end with it."""
    try:
        entry()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # an uncaught exception ends Python with its traceback and 1
        traceback.print_exc()
        return 1
    return 0


@contextlib.contextmanager
def _output_into(stdout, stderr):
    """File descriptors 1 and 2 (Python's and the C libraries' writes alike) into the files."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(stdout.fileno(), 1), os.dup2(stderr.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        os.close(saved[0]), os.close(saved[1])


def _run(command: list[str]) -> dict:
    module, *args = command
    entry = _entry_point(module)
    _flags_at_defaults()
    sys.argv = [sys.modules[module].__file__, *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        with _output_into(out, err):
            code = _exit_code(entry)
        out.seek(0), err.seek(0)
        return {"exit": code, "stdout": out.read(), "stderr": err.read()}


def main(commands_path: str, results_path: str) -> None:
    with open(commands_path) as f:
        commands = json.load(f)
    with open(results_path, "w") as results:
        for command in commands:
            results.write(json.dumps(_run(command)) + "\n")
            results.flush()  # what ran is reported even if a later command kills the process


if __name__ == "__main__":
    main(*sys.argv[1:])
