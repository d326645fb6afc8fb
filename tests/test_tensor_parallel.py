"""Tensor parallelism on N-D meshes: data x fsdp x tensor trains what one device trains (GPT with
Megatron's layout; a user's own Linen and NNX modules), with exactly Megatron's collectives,
tensor-sharded state, and one-line errors for layouts that cannot work. Sequence parallelism:
tests/test_sequence_parallel.py."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

import jddp
from jddp.errors import ConfigError
from jddp.models import create_model
from jddp.observe.memory import peak_bytes, state_bytes_per_device
from jddp.parallel.mesh import DeviceMesh
from tests.helpers import run_cli
from tests.reference import (
    TENSOR_RULES,
    NnxTensorNet,
    TensorNet,
    assert_trees_close,
    make_batches,
    optimizer_for,
    per_example_ce,
    plain_training,
)
from tests.tiny_gpt import (
    BATCH,
    LAYERS,
    SEQ,
    TENSOR_CASES,
    VOCAB,
    WIDTH,
    assert_copies_identical,
    gpt_trainer,
    tensor_group_ops,
    token_batches,
    train_and_compare,
)


@pytest.mark.parametrize("mesh,strategy", TENSOR_CASES)
def test_gpt_matches_one_device(mesh, strategy):
    """Every loss, the parameters and the optimizer state after 20 steps of AdamW with clipping
    and 2 accumulation steps equal the single-device loop's; copies agree bit for bit."""
    trainer, state = train_and_compare(mesh, strategy, sp=False)
    if mesh.startswith("tensor:"):  # devices beyond the mesh's are left out
        assert trainer.num_devices == int(mesh.split(":")[1])
    assert_copies_identical(state)


# ------------------------------------------------------------------------ compiled program
def test_compiled_step_has_exactly_megatrons_collectives_and_sharded_state():
    """fsdp:2,tensor:4 under zero3: per block 2 all-reduces of the activations forward and 2
    backward on the tensor groups, one more each way for the vocabulary-parallel embedding and
    head; nothing else on those groups is as large as a kernel (no kernel is gathered over
    tensor); the state per device follows 12 bytes x (split / (fsdp x tensor) + rest / fsdp)."""
    trainer = gpt_trainer("zero3", "fsdp:2,tensor:4")
    batch = token_batches(steps=1)[0]
    state = trainer.init(seed=0, sample_batch=batch)
    activation = (BATCH // 2) * SEQ * WIDTH * 4  # a device's rows x sequence x width, float32
    ops = tensor_group_ops(trainer, state, batch, tensor=4)
    assert sorted(op for op in ops if op[1] >= activation) == [("all-reduce", activation)] * (
        4 * LAYERS + 2
    )
    smallest_kernel = WIDTH * WIDTH * 4  # attn/out
    assert all(size < smallest_kernel for _, size in ops if size < activation), ops

    # Megatron splits qkv, out, fc, proj and the embedding over tensor; the rest is fsdp only.
    split = VOCAB * WIDTH + LAYERS * (3 * WIDTH * WIDTH + 3 * WIDTH + WIDTH * WIDTH)
    split += LAYERS * (2 * 4 * WIDTH * WIDTH + 4 * WIDTH)
    total = sum(x.size for x in jax.tree.leaves(state.params))
    expected = 12 * (split / 8 + (total - split) / 2)  # fp32 parameters and two Adam moments
    assert state_bytes_per_device(state) == pytest.approx(expected, rel=0.02)
    kernel = state.params["block_0"]["attn"]["qkv"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (WIDTH // 2, 3 * WIDTH // 4)


# -------------------------------------------------------------------- a user's own modules
@pytest.mark.parametrize(
    "kind,strategy,mesh",
    [("linen", "zero3", "data:2,fsdp:2,tensor:2"), ("nnx", "zero1", "fsdp:2,tensor:4")],
)
def test_users_own_module_with_tensor_rules_matches_one_device(kind, strategy, mesh):
    model = TensorNet() if kind == "linen" else NnxTensorNet(nnx.Rngs(0))
    optimizer = optimizer_for(clip=True)
    trainer = jddp.Trainer(
        model,
        per_example_ce,
        optimizer,
        strategy=strategy,
        mesh=mesh,
        rules=TENSOR_RULES,
        min_shard_size=1,
        grad_accum_steps=2,
    )
    batches = make_batches()
    state = trainer.init(seed=0, sample_batch=batches[0])
    assert tuple(state.params["fc"]["kernel"].sharding.spec) == (
        ("fsdp", "tensor") if strategy == "zero3" else (None, "tensor")
    )
    initial = trainer.host_state(state)
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))

    def apply(params, x):
        if kind == "linen":
            return model.apply({"params": params}, x)
        graphdef, _ = nnx.split(model)
        return nnx.merge(graphdef, nnx.State(params))(x)

    def loss_fn(params, model_state, batch):
        return per_example_ce(apply(params, batch["image"]), batch).mean(), model_state

    params, _, expected = plain_training(loss_fn, initial.params, {}, optimizer, batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(trainer.host_state(state).params, params)
    assert_copies_identical(state)


# ------------------------------------------------------------------ memory, dtypes, errors
def test_no_device_ever_holds_a_whole_tensor_split_kernel():
    """tensor:8 alone: initialization draws each shard in place (values equal the unsplit
    initialization, checked by every equivalence test above) and its peak is below one whole
    copy of the split kernels."""
    trainer = gpt_trainer("zero3", "tensor:8")
    batch = token_batches(steps=1)[0]
    abstract = trainer.abstract_state(batch)
    split = [
        x
        for x, spec in zip(
            jax.tree.leaves(abstract.params),
            jax.tree.leaves(trainer.strategy.layout()[0].params),
            strict=True,
        )
        if "tensor" in str(spec)
    ]
    whole = sum(x.size * 4 for x in split)
    peak = peak_bytes(trainer.strategy.lower_init(0, batch["inputs"][:1]).compile())
    assert peak < whole
    state = trainer.init(seed=0, sample_batch=batch)
    kernel = state.params["block_0"]["mlp"]["fc"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(WIDTH, 4 * WIDTH // 8)}


def test_bfloat16_compute_runs_and_learns_with_float32_master_state():
    trainer = gpt_trainer("zero2", "data:2,fsdp:2,tensor:2", compute_dtype="bfloat16")
    batches = token_batches(steps=30)
    state = trainer.init(seed=0, sample_batch=batches[0])
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}


def gpt_args(**fields):
    return dict(num_layers=1, num_heads=4, embed_dim=32, max_seq_len=16) | fields


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: create_model("gpt", 64, tensor_size=8, **gpt_args()), "num_heads=4 does not"),
        (
            lambda: create_model("gpt", 64, tensor_size=8, **gpt_args(num_heads=8, mlp_dim=36)),
            "mlp_dim=36 does not split over tensor=8",
        ),
        (lambda: create_model("gpt", 65, tensor_size=2, **gpt_args()), "vocab_size=66"),
        (
            lambda: create_model("gpt", 64, sequence_parallel=True, **gpt_args()),
            "has none; add one",
        ),
        (lambda: small_trainer("zero3", "model:8"), "unknown axis 'model'; the axes are roles"),
        (lambda: small_trainer("zero3", "data:-1"), "shard nothing (data only replicates); write"),
        (lambda: small_trainer("zero3", "fsdp:4,stage:2"), "stage axis"),
        (
            lambda: small_trainer("zero1", "fsdp:8", rules=[("kernel", "None,tensor")]),
            "names mesh axis 'tensor', but the mesh has axes fsdp",
        ),
        (
            lambda: small_trainer("zero1", "data:2,fsdp:4", rules=[("kernel", "data")]),
            "names the data axis, which only replicates",
        ),
        (
            lambda: small_trainer("zero3", "fsdp:4,tensor:2"),
            "no partition rule splits a parameter over tensor",
        ),
    ],
)
def test_layouts_that_cannot_work_are_one_line_config_errors(build, message):
    with pytest.raises(jddp.ConfigError) as info:
        trainer = build()
        trainer.init(seed=0, sample_batch=make_batches()[0])
    assert message in str(info.value) and "\n" not in str(info.value)


def small_trainer(strategy, mesh, rules=()):
    return jddp.Trainer(
        TensorNet(),
        per_example_ce,
        optimizer_for(clip=False),
        strategy=strategy,
        mesh=mesh,
        rules=rules,
    )


def test_cli_refuses_a_tensor_axis_the_model_cannot_use_and_touches_nothing(tmp_path):
    workdir = tmp_path / "run"
    result = run_cli(
        "--config.parallel.strategy=zero3",
        "--config.parallel.mesh=fsdp:4,tensor:2",
        f"--workdir={workdir}",
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no partition rule splits a parameter over tensor" in lines[0]
    assert not workdir.exists()


def fake_mesh(axes: dict[str, int], devices_per_process: int) -> DeviceMesh:
    """A mesh over fake devices numbered in order, `devices_per_process` to a process."""
    count = int(np.prod(list(axes.values())))
    devices = [SimpleNamespace(process_index=i // devices_per_process) for i in range(count)]
    array = np.array(devices).reshape(tuple(axes.values()))
    return DeviceMesh(SimpleNamespace(devices=array, axis_names=tuple(axes), shape=axes))


@pytest.mark.parametrize("axes,crosses", [(("fsdp", "tensor"), False), (("tensor", "fsdp"), True)])
def test_a_tensor_axis_across_processes_is_detected(axes, crosses):
    """2 processes x 2 devices: tensor as the minor axis stays inside each process."""
    assert fake_mesh(dict.fromkeys(axes, 2), 2).crosses_processes("tensor") == crosses


@pytest.mark.parametrize(
    "axes,devices_per_process,parts",
    [
        ({"data": 2, "fsdp": 2}, 2, [(0, 2), (1, 2)]),  # the batch split across processes
        ({"stage": 2, "data": 2}, 2, [(0, 1), (0, 1)]),  # a stage per process: all rows each
        ({"tensor": 2, "fsdp": 2}, 2, [(0, 1), (0, 1)]),  # tensor across processes
        ({"stage": 2, "data": 2}, 1, [(0, 2), (1, 2), (0, 2), (1, 2)]),
    ],
)
def test_each_process_reads_the_rows_its_devices_hold(axes, devices_per_process, parts):
    mesh = fake_mesh(axes, devices_per_process)
    assert [mesh.row_block(p) for p in range(len(parts))] == parts


def test_a_mesh_whose_processes_share_parts_of_blocks_is_refused():
    """data:3,stage:2 over 2 processes x 3 devices: process 0 holds data slices 0 and 1,
    process 1 slices 1 and 2; no split of the rows feeds both."""
    with pytest.raises(ConfigError, match=r"process 1 batch slices \[1, 2\]"):
        fake_mesh({"data": 3, "stage": 2}, 3).row_block(0)
