"""`parallel.collectives`: auto's choice by platform, a bad value refused in one line, and the
averages across processes (gloo's flat buffers under `cpu`, XLA's tuple all-reduce under
`native`) forced in one process on 8 devices: both choices equal a numpy mean and each other.
(The bfloat16 paths under both choices: tests/test_compression.py; the dispatch bound:
tests/test_trainer.py.)"""

import types

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jddp
from jddp.observe import hlo
from jddp.parallel.collectives import resolve_collectives
from jddp.parallel.grad_reduction import GradComm
from tests.helpers import assert_one_line
from tests.reference import SmallNet, per_example_ce

U, EPS = 2.0**-8, 2.0**-24


def test_auto_takes_the_cpu_workarounds_on_cpus_only():
    assert resolve_collectives("auto", jax.devices()) == "cpu"
    for platform in ("gpu", "tpu"):  # a device's platform is all the choice reads
        assert resolve_collectives("auto", [types.SimpleNamespace(platform=platform)]) == "native"
    assert resolve_collectives("native", jax.devices()) == "native"
    with pytest.raises(jddp.ConfigError) as error:
        jddp.Trainer(SmallNet(), per_example_ce, optax.sgd(0.1), collectives="gpu")
    assert_one_line(error, "parallel.collectives", "'gpu'", "auto, cpu, native")


def per_device_values(seed=0):
    """Per device (leading axis of 8): float32 and float16 tensors, and an int counter that
    averaging leaves alone."""
    rng = np.random.default_rng(seed)
    return {
        "kernel": rng.normal(size=(8, 12, 24)).astype(np.float32),
        "bias": rng.normal(size=(8, 24)).astype(np.float32),
        "scale": rng.normal(size=(8, 5)).astype(np.float16),
        "count": np.arange(8, dtype=np.int32).reshape(8, 1),
    }


def averaged(grad_comm: GradComm, values):
    """`grad_comm.mean` of `values` (gradients: the float32 leaves) and of the rest (extras)
    over 8 devices, as every strategy calls it, and the compiled program's text."""
    mesh = jax.make_mesh((8,), ("batch",))

    def per_device(values):
        values = jax.tree.map(lambda x: x[0], values)
        grads = {k: values[k] for k in ("kernel", "bias")}
        extras = {k: values[k] for k in ("scale", "count")}
        grads, extras, _ = grad_comm.mean(grads, extras, {}, "batch", 0)
        return {**grads, **extras}

    step = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=P("batch"), out_specs=P(), check_vma=False)
    )
    values = jax.device_put(values, jax.NamedSharding(mesh, P("batch")))
    compiled = step.lower(values).compile()
    return jax.device_get(compiled(values)), compiled.as_text()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_choices_average_across_processes_alike(dtype):
    """`spans_processes=True` forces, in one process, what a job over several processes runs:
    under `cpu` the small tensors cross as one flat buffer per dtype, under `native` as XLA's
    combined all-reduce of every tensor."""
    values = per_device_values()
    results, ops = {}, {}
    for choice in ("cpu", "native"):
        grad_comm = GradComm(dtype, collectives=choice, spans_processes=True)
        assert grad_comm.flat_buffers == (choice == "cpu")
        results[choice], text = averaged(grad_comm, values)
        ops[choice] = [op for op in hlo.collective_ops(text) if op.kind != "all-gather"]
    mean = {k: v.astype(np.float64).mean(0) for k, v in values.items()}
    mean_abs = {k: np.abs(v.astype(np.float64)).mean(0) for k, v in values.items()}
    for choice, result in results.items():
        np.testing.assert_array_equal(result["count"], values["count"][0])  # not averaged
        np.testing.assert_allclose(result["scale"], mean["scale"], rtol=1e-3, atol=1e-3)
        for key in ("kernel", "bias"):
            if dtype == "float32":
                np.testing.assert_allclose(result[key], mean[key], rtol=1e-5, atol=1e-6)
            else:  # the all-reduce bound of jddp/parallel/grad_reduction.py
                bound = U * (mean_abs[key] + np.abs(mean[key])) + 2 * (U * U + 16 * EPS) * (
                    mean_abs[key] + np.abs(mean[key])
                )
                assert np.all(np.abs(result[key] - mean[key]) <= bound), (choice, key)
    for key in ("kernel", "bias"):
        apart = 1e-5 * np.abs(mean[key]) + 1e-6 if dtype == "float32" else 2 * U * mean_abs[key]
        assert np.all(np.abs(results["cpu"][key] - results["native"][key]) <= apart), key
    # Flat buffers: one array per all-reduce, and bfloat16's gradients as one all-to-all (of a
    # piece per device) of one buffer; native: one combined all-reduce of several arrays.
    cpu_kinds = [op.kind for op in ops["cpu"]]
    assert cpu_kinds.count("all-to-all") == (dtype == "bfloat16"), ops["cpu"]
    assert all(len(op.sizes) == 1 for op in ops["cpu"] if op.kind == "all-reduce"), ops["cpu"]
    assert [op.kind for op in ops["native"]] == ["all-reduce"] * len(ops["native"])
    assert max(len(op.sizes) for op in ops["native"]) >= 2, ops["native"]
