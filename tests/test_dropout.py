"""Dropout is the same run on every layout: an example's random numbers depend on the seed, the
step and its row of the global batch only (jddp/core/row_keys.py), so training with dropout on 4
or 8 devices, under ddp, ZeRO-3, a tensor mesh, sequence or context parallelism, a pipeline or
gradient accumulation, equals one device — and one device equals a plain optax loop that draws
each step's masks by the documented rule, written here with threefry itself (not jddp's row
keys): element (row, position within the row) of a draw for the whole batch hashes those two
counters under the step's key."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.extend import random as jex_random

import jddp
from jddp.core import row_keys
from jddp.parallel.pipeline.options import PipelineOptions
from tests import tiny_gpt
from tests.reference import (
    assert_trees_close,
    computed_once,
    make_batches,
    per_example_ce,
    plain_training,
)

STEPS = 4
RATE = 0.1


def step_keys(steps):
    """The key of each step of a run from seed 0: TrainState.step_key's, from the third key of
    `jax.random.split(key(0), 3)` (Trainer.init's)."""
    _, _, state_key = jax.random.split(jax.random.key(0), 3)
    return [jax.random.fold_in(state_key, step) for step in range(steps)]


def train(trainer, batches):
    """(initial parameters on the host, final parameters on the host, losses) from seed 0."""
    initial, state, losses = tiny_gpt.run(trainer, batches)
    return initial, trainer.host_state(state).params, losses


def _threefry(key_data):
    return jax.random.wrap_key_data(key_data, impl="threefry2x32")


def _rule_bits(key, bit_width, shape):
    """The documented rule for one device holding the whole batch: element (r, i) of a draw led
    by its rows is threefry2x32 of the counters (r, i) under the key, the two output words
    xor-ed (jax's own draws hash the element's flat index instead)."""
    rows = lax.broadcasted_iota(jnp.uint32, shape, 0).ravel()
    position = jnp.arange(rows.size, dtype=jnp.uint32) % np.uint32(np.prod(shape[1:]))
    hashed = jex_random.threefry_2x32(key, jnp.concatenate([rows, position]))
    bits = hashed[: rows.size] ^ hashed[rows.size :]
    return bits.reshape(shape).astype(f"uint{bit_width}")


# Splits and fold-ins are threefry's: Linen's make_rng and NNX streams derive keys as usual.
RULE_KEYS = jex_random.define_prng_impl(
    key_shape=(2,),
    seed=lambda seed: jax.random.key_data(jax.random.key(seed)),
    split=lambda key, shape: jax.random.key_data(jax.random.split(_threefry(key), shape)),
    random_bits=_rule_bits,
    fold_in=lambda key, data: jax.random.key_data(jax.random.fold_in(_threefry(key), data)),
    name="documented_rows_rule",
    tag="dr",
)


def reference(model, loss_of, params, optimizer, batches, **apply_kwargs):
    """A plain single-device optax loop whose step s draws its masks by the documented rule
    from the step's key."""

    def loss_fn(params, model_state, batch):
        key = jax.random.wrap_key_data(batch["key"], impl=RULE_KEYS)
        outputs = model.apply({"params": params}, batch["x"], rngs={"dropout": key}, **apply_kwargs)
        return loss_of(outputs, batch).mean(), model_state

    keys = step_keys(len(batches))
    batches = [dict(b, key=jax.random.key_data(k)) for b, k in zip(batches, keys, strict=True)]
    return plain_training(loss_fn, params, {}, optimizer, batches)


# ------------------------------------------------------------------------------- row keys
def test_a_draw_for_the_batch_is_the_draws_for_its_slices():
    """Any distribution, dtype and trailing shape: the draw for 8 rows is the draws for 4 slices
    of 2 (and 2 micro-batches of 4, consecutive or in blocks) put together; a draw not led by
    the rows is the same on every
    slice; and the bits look random (a Bernoulli(0.9) rate, rows unlike each other)."""
    key = jax.random.fold_in(jax.random.key(7), 3)
    draws = {
        "bernoulli": lambda k, n: jax.random.bernoulli(k, 0.9, (n, 5, 3)),
        "uniform": lambda k, n: jax.random.uniform(k, (n, 6)),
        "normal16": lambda k, n: jax.random.normal(k, (n, 2, 2), jnp.bfloat16),
        "bits8": lambda k, n: jax.random.bits(k, (n, 7), jnp.uint8),
        "split": lambda k, n: jax.random.uniform(jax.random.split(k)[1], (n,)),
    }
    whole = row_keys.batch_key(key, 0, 8)
    for name, draw in draws.items():
        full = np.asarray(draw(whole, 8))
        slices = [np.asarray(draw(row_keys.batch_key(key, 2 * i, 2), 2)) for i in range(4)]
        micro = [np.asarray(draw(row_keys.sub_batch_key(whole, 4 * i, 4), 4)) for i in range(2)]
        np.testing.assert_array_equal(np.concatenate(slices), full, err_msg=name)
        np.testing.assert_array_equal(np.concatenate(micro), full, err_msg=name)
        # auto's micro-batches: rows 2i, 2i+1 of each of 2 slices of 4 (rows 0,1,4,5; 2,3,6,7)
        for i in range(2):
            blocked = np.asarray(draw(row_keys.blocked_key(key, 2 * i, 4, 2, 4), 4))
            np.testing.assert_array_equal(blocked, full[[2 * i, 2 * i + 1, 2 * i + 4, 2 * i + 5]])
        if name != "bernoulli":  # 15 coin flips at 0.9 may repeat a row
            assert len({row.tobytes() for row in full}) == 8, name
    shared = [jax.random.uniform(row_keys.batch_key(key, 2 * i, 2), (5,)) for i in range(4)]
    for vector in shared[1:]:
        np.testing.assert_array_equal(vector, shared[0])
    rate = jax.random.bernoulli(row_keys.batch_key(key, 0, 64), 0.9, (64, 1000)).mean()
    assert abs(float(rate) - 0.9) < 0.01


# ------------------------------------------------------------------------------ the tiny GPT
GPT_BATCH = 16
GPT_LAYOUTS = {
    "ddp 1": ("ddp", None, dict(devices=jax.devices()[:1])),
    "ddp 4, accumulation 2": ("ddp", None, dict(devices=jax.devices()[:4], grad_accum_steps=2)),
    "ddp 8": ("ddp", None, {}),
    "zero3 fsdp:8": ("zero3", "fsdp:8", {}),
    "zero3 data:2,fsdp:2,tensor:2": ("zero3", "data:2,fsdp:2,tensor:2", {}),
    "sequence parallel fsdp:2,tensor:2": ("zero1", "fsdp:2,tensor:2", dict(sp=True)),
    "auto fsdp:8, accumulation 2": ("auto", "fsdp:8", dict(grad_accum_steps=2)),
    "auto data:2,fsdp:2,tensor:2, sequence parallel": (
        "auto",
        "data:2,fsdp:2,tensor:2",
        dict(sp=True),
    ),
    "context zero3 fsdp:2,context:4 (ring)": ("zero3", "fsdp:2,context:4", {}),
    "context in a pipeline, stage:2,context:2,tensor:2 (all-gather)": (
        "zero2",
        "stage:2,context:2,tensor:2",
        dict(context_attention="all_gather"),
    ),
    "1f1b data:2,stage:2, accumulation 2": (
        "zero1",
        "data:2,stage:2",
        dict(pipeline=PipelineOptions(microbatches=2, schedule="1f1b"), grad_accum_steps=2),
    ),
}


@pytest.fixture(scope="module")
def gpt_reference():
    """The plain loop's losses and parameters for the unrolled tiny GPT with dropout."""
    batches = tiny_gpt.token_batches(steps=STEPS, size=GPT_BATCH)
    model = tiny_gpt.tiny_gpt(dropout_rate=RATE)
    params = tiny_gpt.plain_init()

    def token_ce(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])

    renamed = [{"x": b["inputs"], "label": b["targets"], "targets": b["targets"]} for b in batches]
    final, _, losses = reference(model, token_ce, params, tiny_gpt.adamw(), renamed, train=True)
    return batches, params, final, losses


@pytest.mark.parametrize("layout", GPT_LAYOUTS)
def test_gpt_with_dropout_equals_one_device_on_every_layout(layout, gpt_reference):
    batches, initial_expected, final_expected, expected = gpt_reference
    strategy, mesh, options = GPT_LAYOUTS[layout]
    trainer = tiny_gpt.gpt_trainer(strategy, mesh, dropout=RATE, **options)
    initial, final, losses = train(trainer, batches)
    if "blocks" in initial:  # a pipeline's layers are stacked: the same numbers, stacked
        initial_expected = tiny_gpt.plain_init(stacked=True)
        final_expected = dict(final_expected)
        blocks = [final_expected.pop(f"block_{i}") for i in range(tiny_gpt.LAYERS)]
        final_expected["blocks"] = jax.tree.map(lambda *x: np.stack(x), *blocks)
    jax.tree.map(np.testing.assert_array_equal, initial, initial_expected)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(final, final_expected)


def test_dropout_is_on(gpt_reference):
    """The reference really drops: without dropout its first loss differs."""
    batches, params, _, losses = gpt_reference
    logits = jax.jit(tiny_gpt.tiny_gpt().apply)({"params": params}, batches[0]["inputs"])
    no_dropout = optax.softmax_cross_entropy_with_integer_labels(logits, batches[0]["targets"])
    assert abs(float(no_dropout.mean()) - losses[0]) > 1e-3


# ------------------------------------------------------------------------- a user's modules
class DropNet(nn.Module):
    """A user's Linen module: dropout from the `dropout` stream through make_rng."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.tanh(nn.Dense(24)(x.reshape(x.shape[0], -1)))
        x = nn.Dropout(RATE, deterministic=not train)(x)
        return nn.Dense(5)(x)


class NnxDropNet(nnx.Module):
    """The same in NNX: dropout from `nnx.Rngs`."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(12, 24, rngs=rngs)
        self.dropout = nnx.Dropout(RATE, rngs=rngs)
        self.head = nnx.Linear(24, 5, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(nnx.tanh(self.fc(x.reshape(x.shape[0], -1)))))


USER_LAYOUTS = {
    "ddp 1": dict(devices=jax.devices()[:1]),
    "ddp 4": dict(devices=jax.devices()[:4]),
    "ddp 8, accumulation 2": dict(grad_accum_steps=2),
    "zero3 fsdp:8": dict(strategy="zero3", min_shard_size=1),
    "hybrid data:2,fsdp:2,tensor:2": dict(
        strategy="hybrid",
        mesh="data:2,fsdp:2,tensor:2",
        rules=(("Dense_0/kernel", "fsdp,tensor"), ("Dense_0/bias", "tensor")),
        min_shard_size=1,
    ),
}


def user_trainer(model, **options):
    return jddp.Trainer(model, per_example_ce, optax.adam(3e-3), **options)


def linen_reference(initial, batches):
    """The plain loop's (final parameters, losses) for DropNet from `initial` on `batches`."""
    renamed = [{"x": b["image"], "label": b["label"]} for b in batches]
    final, _, losses = reference(
        DropNet(), per_example_ce, initial, optax.adam(3e-3), renamed, train=True
    )
    return final, losses


@pytest.mark.parametrize("layout", USER_LAYOUTS)
def test_a_users_linen_dropout_equals_one_device(layout):
    batches = make_batches()[:STEPS]
    initial, final, losses = train(user_trainer(DropNet(), **USER_LAYOUTS[layout]), batches)
    # computed once: every layout draws the same initial parameters from seed 0
    expected_final, expected = computed_once(linen_reference, initial, batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(final, expected_final)


def test_a_users_nnx_dropout_is_the_same_on_1_and_8_devices():
    """NNX `Rngs` streams draw through the same row keys: ddp on 8 devices and ZeRO-3 equal one
    device (and dropout changes the loss, so the streams are really used)."""
    batches = make_batches()[:STEPS]
    runs = {
        name: train(user_trainer(NnxDropNet(nnx.Rngs(0)), **USER_LAYOUTS[name]), batches)[2]
        for name in ("ddp 1", "ddp 8, accumulation 2", "zero3 fsdp:8")
    }
    for name, losses in runs.items():
        np.testing.assert_allclose(losses, runs["ddp 1"], rtol=1e-5, err_msg=name)
    no_dropout = NnxDropNet(nnx.Rngs(0))
    no_dropout.eval()
    first = per_example_ce(no_dropout(batches[0]["image"]), batches[0]).mean()
    assert abs(float(first) - runs["ddp 1"][0]) > 1e-4
