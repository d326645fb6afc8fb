"""jddp/runtime/host_memory.py: glibc kept from returning freed host memory, so XLA:CPU's
per-execution buffers stop costing a page fault per 4 KiB on every step. jddp's own entry points
(the CLI, the benchmarks) apply it, or a program calls `keep_freed_memory()`; importing jddp
changes nothing. Checked in fresh processes, by the page faults their repeated executions take
(getrusage)."""

import sys

import pytest

from jddp.runtime import host_memory
from tests.helpers import REPO, run_in_fresh_process

# Fifty executions of a program whose 64 MiB result is freed before the next one: what each
# adds to this process's minor page faults, after 100 warm-up executions. (Under load JAX frees
# some buffers only after the next is allocated, so the heap grows to a high-water mark first:
# ~900 MB within 100 executions with both cores busy, then no fault in 500 more.)
MEASURE = """
import json, resource
import jax, jax.numpy as jnp
from jax._src import xla_bridge
def faults_per_execution():
    twice = jax.jit(lambda x: x * 2.0 + 1.0)
    x = jnp.ones((4096, 4096), jnp.float32)
    def execute():
        y = twice(x)
        y.block_until_ready()
        y.delete()
    for _ in range(100):
        execute()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        execute()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50
"""
PLAIN = MEASURE + "print(json.dumps({'faults': faults_per_execution()}))"
IMPORTED = (
    "from jddp import *\n"  # every public name: the modules behind them imported
    + MEASURE
    + "started = xla_bridge.backends_are_initialized()\n"
    + "print(json.dumps({'faults': faults_per_execution(), 'backend_started_by_import': started}))"
)
CALLED = (
    "from jddp.runtime import host_memory\nhost_memory.keep_freed_memory()\n"
    + MEASURE
    + "print(json.dumps({'faults': faults_per_execution()}))"
)
# The CLI's own start-up (flags, then the settings, then JAX), with the training it would run
# replaced by the measurement: what a `python -m experiments.train` process gets.
THROUGH_THE_CLI = (
    f"import sys; sys.path.insert(0, {REPO!r})\n"
    + MEASURE
    + """
import jddp.run.experiment
from absl import app
from experiments import train
result = {}
def measure_instead(config, workdir, **_):  # train_and_evaluate's signature
    result["faults"] = faults_per_execution()
    return {"eval_accuracy": 0.0, "eval_loss": 0.0, "wall_time_sec": 0.0}
jddp.run.experiment.train_and_evaluate = measure_instead
sys.argv = ["train", "--workdir=/nonexistent-unused"]
try:
    app.run(train.main, flags_parser=train.CONFIG.parse)
except SystemExit:
    pass
print(json.dumps(result))
"""
)
PAGES_OF_RESULT = 4096 * 4096 * 4 // 4096

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not host_memory.glibc(), reason="glibc only"
)


@glibc_only
def test_importing_jddp_leaves_the_allocator_alone():
    imported = run_in_fresh_process(IMPORTED)
    assert not imported["backend_started_by_import"]
    # glibc's defaults fault on every page of the result, every time, with or without jddp.
    assert imported["faults"] >= PAGES_OF_RESULT
    assert run_in_fresh_process(PLAIN)["faults"] >= PAGES_OF_RESULT


@glibc_only
def test_the_explicit_call_and_the_cli_stop_page_faults_on_every_execution():
    assert run_in_fresh_process(CALLED)["faults"] < PAGES_OF_RESULT / 4
    assert run_in_fresh_process(THROUGH_THE_CLI)["faults"] < PAGES_OF_RESULT / 4


# A step's temporaries freed all at once, more than 2 GiB of them: 9 arrays of 256 MiB, each
# malloc'd by numpy from the top of the heap, freed in reverse so the top's free space passes
# 2 GiB, then allocated again. glibc trims free top-of-heap beyond its trim threshold; with any
# finite threshold a bigger step would give its pages back and fault them in again next time
# (tensor:8's 2.5 GB trim in the planner benchmark: 635k faults in 15 steps).
FREED_HEAP_KEPT = """
import json, resource
import numpy as np
from jddp.runtime import host_memory
host_memory.keep_freed_memory()
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
blocks = [None] * 9
for i in range(9):
    blocks[i] = np.ones(2**25)
peak = resident()
for i in reversed(range(9)):
    blocks[i] = None
kept = resident()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(9):
    blocks[i] = np.ones(2**25)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"returned": peak - kept, "faults": faults}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not host_memory.glibc(), reason="glibc only"
)
def test_freed_heap_is_never_trimmed_however_large():
    kept = run_in_fresh_process(FREED_HEAP_KEPT)
    assert kept["returned"] < 2**28, kept  # under one block: none of the 2.25 GiB went back
    assert kept["faults"] < 2**28 // 4096, kept
    # The same through the environment, as a process that does not import jddp gets it
    # (PyTorch in the benchmarks): the variable takes a size, which must be as good as never.
    environment = {**host_memory.ENVIRONMENT, host_memory.OPT_OUT: "0"}
    assert run_in_fresh_process(FREED_HEAP_KEPT, **environment)["returned"] < 2**28


def test_settings_the_user_made_are_left_alone(monkeypatch):
    for name in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(host_memory.OPT_OUT, raising=False)
    assert not host_memory.user_chose()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    assert host_memory.user_chose()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=512")
    assert not host_memory.user_chose()
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert host_memory.user_chose()
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    for off in ("0", "false", "Off", " no "):
        monkeypatch.setenv(host_memory.OPT_OUT, off)
        assert host_memory.user_chose() and not host_memory.keep_freed_memory()
    monkeypatch.setenv(host_memory.OPT_OUT, "1")
    assert not host_memory.user_chose()
