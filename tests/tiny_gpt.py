"""The tiny GPT the tensor- and sequence-parallel tests train (its dimensions, batches and
optimizer from experiments/bench/tiny_gpt.py, which the planner benchmark shares), the meshes they
cover, and the single-device reference they are held to."""

import hashlib

import jax
import numpy as np
import optax

import jddp
from experiments.bench.tiny_gpt import (  # noqa: F401 (tests import them from here)
    BATCH,
    HEADS,
    LAYERS,
    SEQ,
    STEPS,
    VOCAB,
    WIDTH,
    adamw,
    token_batches,
)
from jddp.core.task import jit_init
from jddp.models import GPT
from jddp.models.gpt import TENSOR_PARALLEL_RULES
from jddp.parallel.rules import adapt_preset
from jddp.parallel.strategies import device_mesh_for
from jddp.run.objectives import OBJECTIVES
from tests.reference import assert_optimizer_states_close, assert_trees_close, plain_training

LM = OBJECTIVES["language_model"]


def tiny_gpt(positions="learned", tie=True, layers=LAYERS, **fields):
    """The tiny GPT (`fields` override any of its dimensions, e.g. `vocab_size`)."""
    dimensions = dict(
        vocab_size=VOCAB,
        num_layers=layers,
        num_heads=HEADS,
        embed_dim=WIDTH,
        max_seq_len=SEQ,
        positions=positions,
        tie_embeddings=tie,
    )
    return GPT(**(dimensions | fields))


def mesh_devices(mesh: str):
    """The first devices, as many as `mesh` ("fsdp:2,tensor:2") has."""
    return jax.devices()[: int(np.prod([int(e.split(":")[1]) for e in mesh.split(",")]))]


def gpt_trainer(
    strategy,
    mesh,
    sp=False,
    positions="learned",
    tie=True,
    layers=LAYERS,
    scan=False,
    dropout=0.0,
    seq=SEQ,
    context_attention="ring",
    remat=False,
    **kwargs,
):
    """A Trainer of the tiny GPT (with `dropout`, for sequences of `seq` tokens) on `mesh`
    (Megatron's rules; a stage axis stacks the layers; a context axis splits sequences, whose
    attention is `context_attention`), or under ddp on every device (or `devices=`)."""
    if strategy == "ddp":
        layout = {}
        model = tiny_gpt(
            positions, tie, layers, scan_layers=scan, dropout_rate=dropout, max_seq_len=seq
        )
    else:
        device_mesh = device_mesh_for(strategy, mesh, mesh_devices(mesh))
        layout = {
            "mesh": device_mesh,
            "rules": adapt_preset(TENSOR_PARALLEL_RULES, device_mesh),
            "min_shard_size": 1,
        }
        model = tiny_gpt(
            positions,
            tie,
            layers,
            tensor_axis=device_mesh.tensor_axis,
            sequence_parallel=sp,
            scan_layers=scan or device_mesh.stage_axis is not None,
            dropout_rate=dropout,
            max_seq_len=seq,
            context_axis=device_mesh.context_axis,
            context_attention=context_attention,
            remat=remat,
        )
    return jddp.Trainer(
        model,
        LM.loss_fn,
        kwargs.pop("optimizer", adamw()),
        metrics=dict(LM.metrics),
        input_key="inputs",
        strategy=strategy,
        **layout,
        **kwargs,
    )


def plain_init(positions="learned", tie=True, layers=LAYERS, stacked=False, seq=SEQ):
    """The tiny GPT's parameters from a plain Flax `init` of the unrolled model on one device for
    seed 0, with the parameter key `Trainer.init(seed=0)` uses (the first of
    `jax.random.split(key(0), 3)`); `stacked`: its `block_i` stacked into `blocks` (jddp's promise:
    stacking is a layout, the same parameters)."""
    params_key, dropout_key, _ = jax.random.split(jax.random.key(0), 3)
    model = tiny_gpt(positions, tie, layers, max_seq_len=seq)
    inputs = np.zeros((1, seq), np.int32)
    # Compiled with the options Trainer.init uses: eager ops, or other options, round some draws
    # differently (1 ulp).
    variables = jit_init(model.init, {"params": params_key, "dropout": dropout_key}, inputs)
    params = jax.device_get(variables["params"])
    if stacked:
        blocks = [params.pop(f"block_{i}") for i in range(layers)]
        params["blocks"] = jax.tree.map(lambda *leaves: np.stack(leaves), *blocks)
    return params


def _digest(batches) -> str:
    hashed = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch):
            hashed.update(name.encode() + np.ascontiguousarray(batch[name]).tobytes())
    return hashed.hexdigest()


_REFERENCES = {}


def reference_from(positions, tie, initial, layers=LAYERS, batches=None):
    """The plain single-device loop on `batches` (params, model_state, losses, opt_state), from
    the plain init (`plain_init`), which `initial` (a layout's own initialization) must equal bit
    for bit. Computed once per model variant and batches. Stacked layers (`blocks/`) run as one
    scan, per-layer ones one by one."""
    stacked = "blocks" in initial
    batches = batches or token_batches()
    seq = batches[0]["inputs"].shape[1]
    key = (positions, tie, layers, stacked, _digest(batches))
    if key not in _REFERENCES:
        model = tiny_gpt(positions, tie, layers, scan_layers=stacked, max_seq_len=seq)

        def loss_fn(params, model_state, batch):
            logits = model.apply({"params": params}, batch["inputs"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return ce.mean(), model_state

        plain = plain_init(positions, tie, layers, stacked, seq)
        _REFERENCES[key] = (plain, plain_training(loss_fn, plain, {}, adamw(), batches, True))
    plain, result = _REFERENCES[key]
    jax.tree.map(np.testing.assert_array_equal, initial, plain)  # sharded init = plain init
    return result


# Meshes on 8 devices: each of the six meshes the docs name, with and without sequence
# parallelism. Across the two lists no (ZeRO stage, mesh with fsdp) pair repeats: 6 of the 9,
# every stage on two of the meshes, every mesh under two stages; on meshes without fsdp every
# ZeRO stage is the same layout.
TENSOR_CASES = [
    ("tensor:4", "zero3"),
    ("data:2,tensor:2", "zero3"),
    ("fsdp:2,tensor:2", "zero1"),
    ("data:2,fsdp:2,tensor:2", "zero2"),
    ("fsdp:2,tensor:4", "zero3"),
    ("tensor:2", "zero1"),
]
SEQUENCE_CASES = [
    ("tensor:2", "zero3"),
    ("data:2,tensor:2", "zero3"),
    ("fsdp:2,tensor:2", "zero3"),
    ("data:2,fsdp:2,tensor:2", "zero1"),
    ("fsdp:2,tensor:4", "zero2"),
    ("tensor:4", "zero1"),
]
VARIANTS = [("learned", True), ("rotary", False), ("rotary", True), ("learned", False)]


def run(trainer, batches):
    """(initial parameters on the host, final state, each step's loss) of training on
    `batches` from seed 0."""
    state = trainer.init(seed=0, sample_batch=batches[0])
    initial = trainer.host_state(state).params
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return initial, state, losses


def check_against_reference(trainer, batches, positions="learned", tie=True, layers=LAYERS):
    """Trains on `batches`; every loss, the parameters and the optimizer state must equal the
    single-device loop's. Returns the final state."""
    initial, state, losses = run(trainer, batches)
    params, _, expected, opt_state = reference_from(positions, tie, initial, layers, batches)
    final = trainer.host_state(state)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(final.params, params)
    assert_optimizer_states_close(final.opt_state, opt_state)
    assert expected[-1] < 0.8 * expected[0]  # it learned something
    return state


def train_and_compare(mesh, strategy, sp, **kwargs):
    """20 steps of AdamW with clipping and 2 accumulation steps on `mesh`, checked against the
    single-device loop. Returns the trainer and its final state."""
    cases = SEQUENCE_CASES if sp else TENSOR_CASES
    positions, tie = VARIANTS[(cases.index((mesh, strategy)) + sp) % len(VARIANTS)]
    trainer = gpt_trainer(strategy, mesh, sp, positions, tie, grad_accum_steps=2, **kwargs)
    return trainer, check_against_reference(trainer, token_batches(), positions, tie)


def assert_copies_identical(tree):
    """Every device holding the same part of a leaf (a replica over data, fsdp or tensor) holds
    bit-identical values."""
    for leaf in jax.tree.leaves(tree):
        by_index = {}
        for shard in leaf.addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index)
            by_index.setdefault(key, []).append(np.asarray(shard.data))
        for copies in by_index.values():
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0])


def tensor_group_ops(trainer, state, batch, tensor: int):
    """(kind, bytes) of every collective in the compiled step over groups of `tensor` devices
    (the tensor groups on a mesh whose other axes have another size)."""
    from jddp.observe.hlo import collectives

    placed = trainer.place_batch(batch).arrays
    text = trainer.strategy.lower_train_step(state, placed).compile().as_text()
    return [
        (kind, size)
        for kind, sizes, group in collectives(text)
        if group == tensor
        for size in sizes
    ]
