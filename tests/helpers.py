"""Shared by tests: running the CLI in a real subprocess; training steps with their losses;
programs compiled with full optimization."""

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from jddp.runtime import host_memory
from jddp.runtime.launch import with_cpu_devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a process running JAX's coordinator says when it cannot bind the port it was given (a
# port picked free may be taken by another program before the coordinator binds it).
PORT_TAKEN = "Failed to start RPC server"


def small_net_trainer(
    strategy="ddp", num_devices=8, mesh=None, *, model=None, optimizer=None, **kwargs
):
    """A `jddp.Trainer` of `model` (SmallNet) with `optimizer` (Adam with clipping) and
    per-example cross-entropy under `strategy`, on the first `num_devices` devices; sharded
    strategies on `mesh` with every tensor sharded (`min_shard_size` 1 unless given)."""
    import jddp
    from tests.reference import SmallNet, optimizer_for, per_example_ce

    if strategy != "ddp":
        kwargs = {"mesh": mesh, "min_shard_size": 1, **kwargs}
    elif mesh is not None:
        kwargs["mesh"] = mesh  # refused: ddp takes no mesh
    return jddp.Trainer(
        model or SmallNet(),
        per_example_ce,
        optimizer or optimizer_for(clip=True),
        strategy=strategy,
        devices=jax.devices()[:num_devices],
        **kwargs,
    )


# A child's environment entry that compiles its programs as users' runs do (tests/conftest.py
# makes every child compile unoptimized, as the test processes do).
OPTIMIZED_CHILD = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "false"}


def xla_flags(devices: int) -> str:
    """The test processes' XLA_FLAGS (tests/conftest.py's compile flags) with `devices`
    simulated CPU devices: for a child that runs on another device count."""
    return with_cpu_devices(os.environ["XLA_FLAGS"], devices)


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment (8 simulated devices, the test TFDS data dir) with the checkout
    on PYTHONPATH: `experiments` is not installed, so a child run elsewhere finds it there."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@contextlib.contextmanager
def optimized_compiles():
    """Programs compiled inside compile as users' do (for tests whose run time dominates: a run
    to an accuracy target; measured: a bfloat16 CNN run 42 s optimized, 380 s not)."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def run_cli(*args: str, cwd=REPO, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """`python -m experiments.train ARGS` in `cwd`, in `checkout_env()` (plus `env`); killed after
    `timeout` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=checkout_env(**(env or {})),
    )


def train_steps(trainer, state, batches):
    """`trainer.step` on each batch in turn; returns the state and each step's loss."""
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def train_from(trainer, params, batches):
    """`trainer` trained on `batches` from the given initial `params` (host arrays, e.g. a
    reference's own initialization); returns the state and each step's metrics as floats."""
    state = trainer.replace_state(trainer.init(seed=0, sample_batch=batches[0]), params=params)
    history = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        history.append({name: float(value) for name, value in metrics.items()})
    return state, history


def compiled_train_step(trainer, batch):
    """`trainer`'s train step compiled for `batch` and the state's shapes and shardings (the
    program a real state runs, without initializing one)."""
    placed = trainer.place_batch(batch).arrays
    return trainer.strategy.lower_train_step(trainer.abstract_state(batch), placed).compile()


def save_and_restore(writer, state, reader, sample_batch, directory: str, step: int = 10):
    """Saves `state` of `writer` as checkpoint `step` in `directory` and restores it into
    `reader`'s layout (orbax reshards on load; stacked and per-layer blocks convert); returns
    (step, state, meta)."""
    from jddp.checkpoints.compatibility import restore_layout
    from jddp.checkpoints.store import Checkpoints

    checkpoints = Checkpoints(directory, every=step, max_to_keep=2)
    checkpoints.save(step, writer.global_state(state), {"data": None}, force=True)
    checkpoints.wait()
    checkpoints.close()
    checkpoints = Checkpoints(directory, every=step, max_to_keep=2)
    try:
        return checkpoints.restore_latest(
            reader.abstract_state(sample_batch), layout=restore_layout
        )
    finally:
        checkpoints.close()


def snapshot(root) -> dict[str, str]:
    """{path relative to `root`: sha256 of the file, or "dir"} for everything under `root`: equal
    snapshots mean nothing was written, created, removed or moved."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = "dir"
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


@contextlib.contextmanager
def read_only_dir(path):
    """`path` made a directory nobody may write to: a read-only tmpfs where this process may
    mount one (root), else a directory without write permission."""
    os.makedirs(path)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        if os.geteuid() == 0:  # root writes through permissions
            pytest.skip("root, but no tmpfs mount allowed: no read-only directory to test with")
        os.chmod(path, 0o555)
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(path)], check=True)
        else:
            os.chmod(path, 0o755)


def assert_one_line(error, *words) -> None:
    """`error` (a pytest.raises result) is one line holding each of `words`."""
    message = str(error.value)
    assert "\n" not in message, message
    _assert_holds(message, words)


def assert_error_output(text: str, *words) -> str:
    """`text` (a program's stderr) is one line, `error: ...`, holding each of `words`; returns
    that line."""
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    _assert_holds(lines[0], words)
    return lines[0]


def assert_error_exit(result: subprocess.CompletedProcess, *words, code: int = 2) -> str:
    """`result` exited with `code` (2: a usage error) and said why in one `error:` line holding
    each of `words`; returns that line."""
    assert result.returncode == code, result.stderr
    return assert_error_output(result.stderr, *words)


def error_line(output: str, prefix: str = "") -> str:
    """The one line of `output` (among others) starting with `prefix` + "error: "."""
    lines = [line for line in output.splitlines() if line.startswith(prefix + "error: ")]
    assert len(lines) == 1, output
    return lines[0]


def _assert_holds(line: str, words) -> None:
    for word in words:
        assert word in line, (word, line)


def param_count(model, *inputs, **kwargs) -> int:
    """How many parameters `model.init(key, *inputs, **kwargs)` makes, from shapes alone
    (nothing is allocated)."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *inputs, **kwargs))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))


# A short run of the digits MLP: checkpoints at steps 5 and 10.
SMALL = {
    "num_train_steps": 10,
    "log_every": 5,
    "eval_every": 10,
    "checkpoint_every": 5,
    "warmup_steps": 0,
    "max_to_keep": 2,
}
SMALL_FLAGS = [f"--config.{key}={value}" for key, value in SMALL.items()]


def small_config(**overrides):
    """experiments/configs/digits_mlp.py with `SMALL`'s settings and then `overrides`."""
    from experiments.configs import digits_mlp

    config = digits_mlp.get_config()
    for key, value in {**SMALL, **overrides}.items():
        setattr(config, key, value)
    return config


def run_in_fresh_process(program: str, **env) -> dict:
    """Runs `program` (Python source printing one JSON line last) in a fresh interpreter on one
    device, with none of this process's malloc settings: the child decides only by `env`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    for name in (host_memory.OPT_OUT, "GLIBC_TUNABLES"):
        environ.pop(name, None)
    environ["XLA_FLAGS"] = xla_flags(1)
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def metrics_lines(workdir) -> list[str]:
    """The complete lines of `workdir`'s metrics.jsonl (a line cut short by a kill is left out)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line[:-1] for line in f if line.endswith("\n")]


def committed_checkpoints(workdir) -> dict[int, tuple[int, int]]:
    """{step: (inode, mtime)} of `workdir`'s committed checkpoints (orbax writes a save in
    progress to STEP.orbax-checkpoint-tmp-*, and renames it to STEP when it is complete)."""
    folder = os.path.join(workdir, "checkpoints")
    found = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.isdigit():
            stat = os.stat(os.path.join(folder, name))
            found[int(name)] = (stat.st_ino, stat.st_mtime_ns)
    return found


class BeforeRerun:
    """What a workdir holds before a run resumes it: its records and committed checkpoints, and
    the step it must resume from (its newest checkpoint unless `resume_step` says otherwise).

    `assert_resumed` then proves the run resumed there and did not train from scratch (training
    is deterministic, so equal end results alone cannot tell)."""

    def __init__(self, workdir, resume_step: int | None = None):
        self.workdir = str(workdir)
        self.lines = metrics_lines(self.workdir)
        self.checkpoints = committed_checkpoints(self.workdir)
        self.resume_step = max(self.checkpoints, default=0) if resume_step is None else resume_step

    def assert_resumed(self, log_every: int) -> None:
        """The run since kept the records up to `resume_step` as they were and wrote its own from
        the next logged step on (timings make each run's records differ), and rewrote no
        checkpoint at or below `resume_step`."""
        old = set(self.lines)
        after = metrics_lines(self.workdir)
        kept = [json.loads(line)["step"] for line in after if line in old]
        written = [json.loads(line)["step"] for line in after if line not in old]
        expected = [json.loads(line)["step"] for line in self.lines]
        assert kept == [s for s in expected if s <= self.resume_step], (kept, self.resume_step)
        first = (self.resume_step // log_every + 1) * log_every
        assert written and written[0] == first, (
            f"expected a run resumed at step {self.resume_step}: first record at step {first}, "
            f"got the steps {written[:3]}"
        )
        for step, identity in committed_checkpoints(self.workdir).items():
            if step <= self.resume_step:
                assert self.checkpoints.get(step) == identity, f"checkpoint {step} was rewritten"


def assert_accuracy_over(accuracy: float, examples: int) -> None:
    """`accuracy` is k / `examples` for a whole number k: each of the eval split's examples
    counted once (padding rows masked out, none dropped or repeated)."""
    hits = accuracy * examples
    assert 0 <= accuracy <= 1 and abs(hits - round(hits)) < 1e-3, (accuracy, examples)


def requires_data(path: str, how: str) -> None:
    """Skips the calling test when `path` (real data it reads) is missing, saying `how` to get
    it; under CI (CI=true, as `.ci/run` sets) a missing file fails the test instead."""
    if os.path.exists(path):
        return
    reason = f"{path} is missing: {how}"
    if os.environ.get("CI") == "true":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def launch_command(nproc: int, devices_per_proc: int, program: str | None = None) -> list[str]:
    """The `jddp-launch` command line up to its `--`: `nproc` processes of simulated devices;
    `program`: the launcher to run (default: this interpreter's `-m jddp.runtime.launch`)."""
    launcher = [program] if program else [sys.executable, "-m", "jddp.runtime.launch"]
    return [
        *launcher, f"--nproc={nproc}", f"--devices_per_proc={devices_per_proc}", "--",
    ]  # fmt: skip


def safetensors_in(path) -> dict[str, np.ndarray]:
    """Every tensor of every `.safetensors` file in the directory `path`, by name."""
    from safetensors.numpy import load_file

    found = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            found |= load_file(os.path.join(path, name))
    return found


def tiny_llama_config(**overrides):
    """transformers' LlamaConfig of the tests' tiny Llama (2 layers of width 32, 4 query heads,
    2 key/value heads, untied), with `overrides`."""
    import transformers

    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaConfig(**(fields | overrides))


@contextlib.contextmanager
def launched(program: str, nproc: int = 2, hard_timeout_s: float = 120):
    """A real `jddp-launch --nproc=NPROC -- python -c PROGRAM` (its output in `.stdout`, text),
    SIGKILLed when the block ends or `hard_timeout_s` passes (reading its output then ends)."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jddp.runtime.launch", f"--nproc={nproc}", "--"]
        + [sys.executable, "-c", program],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    hard_kill = threading.Timer(hard_timeout_s, launcher.kill)
    hard_kill.start()
    try:
        yield launcher
    finally:
        hard_kill.cancel()
        launcher.kill()
        launcher.wait()


def tiny_jddp_llama():
    """(a jddp Llama of one layer of width 8 and 16 tokens, random float32 parameters for it),
    without compiling anything: enough to write and read a Hugging Face directory."""
    from jddp import models

    model = models.MODELS["llama"](
        vocab_size=16, num_layers=1, num_heads=2, embed_dim=8, max_seq_len=8
    )
    tokens = jax.numpy.zeros((1, 4), np.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))["params"]
    rng = np.random.default_rng(0)
    return model, jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


def config_flags(settings: dict) -> list[str]:
    """{dotted config key: value} as the command's `--config.KEY=VALUE` flags."""
    return [f"--config.{key}={value}" for key, value in settings.items()]


def configured(config, settings: dict):
    """`config` with each {dotted key: value} of `settings` set, as `config_flags(settings)` set
    them on the command line; returns `config`."""
    for key, value in settings.items():
        *path, leaf = key.split(".")
        node = config
        for name in path:
            node = node[name]
        node[leaf] = value
    return config


def fail_state_restores(monkeypatch, error: BaseException) -> None:
    """Every orbax restore of a checkpoint's `state` item raises `error` (its metadata still
    reads): a read that fails for a reason other than damage."""
    import orbax.checkpoint as ocp

    real = ocp.CheckpointManager.restore

    def restore(self, step, *args, **kwargs):
        if "state" in kwargs.get("args", {}).keys():
            raise error
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
