"""Test setup: 8 simulated CPU devices, a private TFDS data dir and a shared compilation cache,
before JAX is imported; programs compiled in the test processes quickly: without LLVM
optimization, and with XLA:CPU's legacy fusion emitters (see below)."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# Datasets and compiled programs go to a directory made for this test run, never to one an older
# run (older code) left behind nor to the developer's own $TFDS_DATA_DIR. The process that makes
# it (pytest, or pytest-xdist's controller) hands it down in the environment: workers and the
# programs tests start prepare and read the same data, and the maker removes it at the end.
_RUN_DIR_VAR = "JDDP_TEST_RUN_DIR"
_MADE_RUN_DIR = _RUN_DIR_VAR not in os.environ
if _MADE_RUN_DIR:
    os.environ[_RUN_DIR_VAR] = tempfile.mkdtemp(prefix="jddp-test-run-")
# XLA:CPU's legacy fusion emitters compile in about half the time of its MLIR ones, the default
# (tests/test_pipeline.py, test_context_parallel.py, test_moe.py and test_dropout.py: 5:19 ->
# 3:00 on 2 workers; a fresh clone's whole suite 24:15 -> 16:43). The programs tests start
# inherit the flag through XLA_FLAGS (`tests.helpers.xla_flags`).
LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _known_to_xla(flags: str) -> bool:
    """Whether this jaxlib starts with `flags`: XLA aborts a process on a flag it does not know
    (as a later jaxlib may, once the legacy emitters are gone), so a child tries them first."""
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    try:
        result = subprocess.run(
            probe, env={**os.environ, "XLA_FLAGS": flags}, capture_output=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0


def _with(flags: str, flag: str) -> str:
    return flags if flag in flags.split() else f"{flags} {flag}".strip()


os.environ["XLA_FLAGS"] = _with(
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"
)
_LEGACY = _with(os.environ["XLA_FLAGS"], LEGACY_EMITTERS_FLAG)
if _MADE_RUN_DIR and _known_to_xla(_LEGACY):  # workers and the programs tests start inherit it
    os.environ["XLA_FLAGS"] = _LEGACY
os.environ["TFDS_DATA_DIR"] = os.path.join(os.environ[_RUN_DIR_VAR], "tfds")
# JAX's persistent compilation cache, for the programs the tests start (the CLI, launched
# processes): hundreds of them compile the same few programs (a CLI run of the digits MLP: 4.3
# CPU-s, 2.9 with its programs cached). Every program is cached, however quick its compile; a
# size limit turns on the cache's file lock, so that no process reads an entry another is still
# writing. The test processes themselves keep it off (below).
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ[_RUN_DIR_VAR], "compiled")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)

import jax  # noqa: E402

assert jax.device_count() == 8, "conftest must run before anything imports jax"

# Most tests compile far longer than they run (a tiny GPT's step: 7 s to compile, 20 steps in
# under a second), so the test processes compile as `jax_disable_most_optimizations` says: the
# same HLO program, its machine code from LLVM unoptimized (tensor- and sequence-parallel tests
# ~25% faster). References are compiled the same way, in the same process. The programs tests
# start (the CLI, multi-process runs) inherit it through the environment; a test that trains for
# real uses the `optimized` fixture, or OPTIMIZED_CHILD in its child's environment.
jax.config.update("jax_disable_most_optimizations", True)
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
# The test processes compile mostly programs no other process compiles, and keep theirs in
# memory: writing each to the cache cost them more than it saved (tests/test_experiment.py and
# test_train_command.py: 2 CPU-s more with it).
jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture
def optimized():
    """`optimized_compiles()` around one test."""
    from tests.helpers import optimized_compiles

    with optimized_compiles():
        yield


@pytest.fixture(scope="session", autouse=True)
def shared_digits_prepared():
    """The shared digits dataset is prepared before any test runs, so no test's output depends on
    whether it happened to be the one that prepared it (one preparer at a time: a file lock)."""
    from jddp import data

    data.open_dataset(data.get_dataset("digits"))


# The longest files (test seconds of a fresh-clone run, `pytest --durations=0`, 2 workers),
# started first: with `--dist loadfile` each file runs on one worker, so a long file handed out
# last would leave the other worker idle while it finishes. pytest-xdist would hand the files out
# by their number of tests instead; `pytest_configure` keeps this order.
LONGEST_FIRST = (
    "test_docs.py",
    "test_pipeline.py",
    "test_fashion_mnist.py",
    "test_context_parallel.py",
    "test_multiprocess.py",
    "test_hf_checkpoints.py",
    "test_pipeline_runs.py",
    "test_resume_kill.py",
    "test_restarts.py",
    "test_planner.py",
    "test_watchdog.py",
    "test_hf_commands.py",
    "test_compression.py",
    "test_tensor_parallel.py",
    "test_own_models.py",
    "test_sharding.py",
    "test_experiment.py",
    "test_host_memory.py",
    "test_checkpoint.py",
    "test_cli_errors.py",
    "test_dropout.py",
    "test_bad_input.py",
    "test_own_data.py",
    "test_loop.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's, on by default
        config.option.loadscopereorder = False


def pytest_unconfigure(config):
    if _MADE_RUN_DIR:
        shutil.rmtree(os.environ[_RUN_DIR_VAR], ignore_errors=True)


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order inside each file is kept
