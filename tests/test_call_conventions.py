"""Flax modules called the way the Flax examples call theirs train without a wrapper: a tagger
that takes keyword inputs, an attention mask and segment ids from named batch entries and
`deterministic` rather than `train` (as the Flax NLP examples' Transformers do), with a
token-weighted loss (nlp_seq's); and an NNX module whose `__call__` takes `rngs` (the Flax NNX
MNIST example's style). Each under ddp, ZeRO-1/2/3 and hybrid against the plain single-device
reference; dropout is on in training and off in eval."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from tests.helpers import assert_one_line, train_from
from tests.reference import assert_trees_close, per_example_ce, plain_training

VOCAB, TAGS, SEQ, GLOBAL_BATCH, STEPS = 13, 4, 6, 16, 3
# `mask` is jddp's own entry in eval (1 for real examples, 0 for padding): attention masks go by
# another name.
TAGGER_INPUTS = {"inputs": "tokens", "mask": "attention_mask", "segments": "segments"}


class Tagger(nn.Module):
    """Keyword-only inputs with a padding mask and segment ids; `deterministic`, not `train`."""

    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, *, inputs, mask, segments, deterministic: bool):
        x = nn.Embed(VOCAB, 16, name="embed")(inputs)
        x = x + nn.Embed(2, 16, name="segment_embed")(segments)
        # Each token sees the mean of the real tokens of its own segment (attention, flattened).
        seen = (segments[:, :, None] == segments[:, None, :]) & (mask[:, None, :] > 0)
        seen = seen.astype(x.dtype)
        context = jnp.einsum("bqk,bkd->bqd", seen, x) / jnp.maximum(seen.sum(-1)[..., None], 1)
        x = x + nn.Dense(16, name="mix")(context)
        x = nn.Dropout(self.dropout_rate)(nn.relu(x), deterministic=deterministic)
        return nn.Dense(TAGS, name="head")(x)


def tagging_loss(logits, batch):
    """Token cross-entropy weighted by the padding mask: (weighted sum, weight) per sequence."""
    weights = batch["attention_mask"].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tags"])
    return jnp.sum(losses * weights, axis=-1), jnp.sum(weights, axis=-1)


def tag_accuracy(logits, batch):
    weights = batch["attention_mask"].astype(jnp.float32)
    hits = (jnp.argmax(logits, -1) == batch["tags"]).astype(jnp.float32)
    return jnp.sum(hits * weights, axis=-1), jnp.sum(weights, axis=-1)


def tagging_batches(seed=0, steps=STEPS):
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        lengths = rng.integers(0, SEQ + 1, size=GLOBAL_BATCH)
        lengths[:5] = 0  # whole devices' slices are padding
        mask = (np.arange(SEQ) < lengths[:, None]).astype(np.int32)
        batches.append(
            {
                "tokens": rng.integers(1, VOCAB, size=(GLOBAL_BATCH, SEQ)).astype(np.int32) * mask,
                "attention_mask": mask,
                "segments": (np.arange(SEQ) >= SEQ // 2).astype(np.int32)[None].repeat(16, 0),
                "tags": rng.integers(0, TAGS, size=(GLOBAL_BATCH, SEQ)).astype(np.int32),
            }
        )
    return batches


@jax.jit
def reference_tagging(params, batch):
    """(loss, accuracy) over every real token of `batch`, on one device, dropout off."""
    inputs = {arg: batch[entry] for arg, entry in TAGGER_INPUTS.items()}
    logits = Tagger().apply({"params": params}, **inputs, deterministic=True)
    loss, weight = tagging_loss(logits, batch)
    hits, _ = tag_accuracy(logits, batch)
    return jnp.sum(loss) / jnp.sum(weight), jnp.sum(hits) / jnp.sum(weight)


STRATEGIES = [
    ("ddp", None, 1),
    ("zero1", None, 1),
    ("zero2", None, 2),
    ("zero3", None, 2),
    ("hybrid", "data:2,fsdp:4", 1),
]


@functools.cache
def tagger_reference():
    """(initial parameters, final parameters, losses) of the plain loop: shared by every case."""
    data = tagging_batches()
    inputs = {arg: data[0][entry][:1] for arg, entry in TAGGER_INPUTS.items()}
    initial = Tagger().init(jax.random.key(1), **inputs, deterministic=True)["params"]

    def reference_loss(params, model_state, batch):
        return reference_tagging(params, batch)[0], model_state

    params, _, losses = plain_training(reference_loss, initial, {}, optax.adam(1e-2), data)
    return jax.device_get(initial), params, losses


@pytest.mark.parametrize("strategy,mesh,grad_accum_steps", STRATEGIES)
def test_keyword_inputs_and_token_weights_match_one_device(strategy, mesh, grad_accum_steps):
    data = tagging_batches()
    initial, params, expected = tagger_reference()
    trainer = jddp.Trainer(
        Tagger(),
        tagging_loss,
        optax.adam(1e-2),
        metrics={"accuracy": tag_accuracy},
        strategy=strategy,
        mesh=mesh,
        min_shard_size=64,  # small tensors sharded too
        grad_accum_steps=grad_accum_steps,
        input_key=TAGGER_INPUTS,
    )
    state, history = train_from(trainer, initial, data)
    assert_trees_close(trainer.host_state(state).params, params)
    np.testing.assert_allclose([m["loss"] for m in history], expected, rtol=1e-5)
    if strategy in ("ddp", "zero3"):
        ragged = [data[0], {k: v[:7] for k, v in data[1].items()}]
        whole = {k: np.concatenate([b[k] for b in ragged]) for k in ragged[0]}
        result = trainer.evaluate(state, ragged)
        loss, accuracy = reference_tagging(params, whole)
        np.testing.assert_allclose(
            [result["loss"], result["accuracy"]], [loss, accuracy], rtol=1e-5
        )


def test_deterministic_turns_dropout_on_in_training_only():
    batch = tagging_batches(seed=1, steps=1)[0]
    trainer = jddp.Trainer(
        Tagger(dropout_rate=0.5),
        tagging_loss,
        optax.sgd(0.0),  # parameters never move: only dropout masks change the loss
        devices=jax.devices()[:2],
        input_key=TAGGER_INPUTS,
    )
    state = trainer.init(seed=0, sample_batch=batch)
    losses = []
    for _ in range(2):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    expected = float(reference_tagging(trainer.host_state(state).params, batch)[0])
    assert losses[0] != losses[1] and expected not in losses
    assert trainer.evaluate(state, [batch])["loss"] == pytest.approx(expected, rel=1e-5)


class NnxMnistStyle(nnx.Module):
    """As the Flax NNX MNIST example writes its CNN: a Dropout with no RNG of its own, fed the
    `rngs` that `__call__` takes."""

    def __init__(self, rate: float, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(12, 24, rngs=rngs)
        self.dropout = nnx.Dropout(rate)
        self.linear2 = nnx.Linear(24, 5, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = nnx.relu(self.linear1(x.reshape(x.shape[0], -1)))
        return self.linear2(self.dropout(x, rngs=rngs))


class LinenMnistStyle(nn.Module):
    """NnxMnistStyle in Linen, without dropout (the reference for rate 0)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(24, name="linear1")(x.reshape(x.shape[0], -1)))
        return nn.Dense(5, name="linear2")(x)


def image_batches(seed=0, steps=STEPS):
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.normal(size=(GLOBAL_BATCH, 4, 3)).astype(np.float32),
            "label": rng.integers(0, 5, size=GLOBAL_BATCH).astype(np.int32),
        }
        for _ in range(steps)
    ]


@functools.cache
def nnx_reference():
    data = image_batches()
    initial = LinenMnistStyle().init(jax.random.key(1), data[0]["image"][:1])["params"]

    def reference_loss(params, model_state, batch):
        logits = LinenMnistStyle().apply({"params": params}, batch["image"])
        return per_example_ce(logits, batch).mean(), model_state

    params, _, losses = plain_training(reference_loss, initial, {}, optax.adam(1e-2), data)
    return jax.device_get(initial), params, losses


@pytest.mark.parametrize("strategy,mesh,grad_accum_steps", [STRATEGIES[0], *STRATEGIES[3:]])
def test_nnx_module_taking_rngs_matches_one_device(strategy, mesh, grad_accum_steps):
    data = image_batches()
    initial, params, expected = nnx_reference()
    trainer = jddp.Trainer(
        NnxMnistStyle(0.0, rngs=nnx.Rngs(0)),
        per_example_ce,
        optax.adam(1e-2),
        strategy=strategy,
        mesh=mesh,
        min_shard_size=64,
        grad_accum_steps=grad_accum_steps,
    )
    state, history = train_from(trainer, initial, data)
    assert_trees_close(trainer.host_state(state).params, params)
    np.testing.assert_allclose([m["loss"] for m in history], expected, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_nnx_rngs_turn_dropout_on_in_training_only(strategy):
    batch = image_batches(seed=1, steps=1)[0]
    model = NnxMnistStyle(0.5, rngs=nnx.Rngs(0))
    trainer = jddp.Trainer(model, per_example_ce, optax.sgd(0.0), strategy=strategy)
    state = trainer.init(seed=0, sample_batch=batch)
    losses = []
    for _ in range(2):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[0] != losses[1]  # a fresh mask each step
    model.eval()  # reference: the user's own module in eval mode, called directly
    expected = float(per_example_ce(model(batch["image"]), batch).mean())
    assert expected not in losses
    assert trainer.evaluate(state, [batch])["loss"] == pytest.approx(expected, rel=1e-5)


def test_inputs_the_module_cannot_take_are_one_line_errors():
    with pytest.raises(jddp.ConfigError) as error:
        jddp.Trainer(Tagger(), tagging_loss, optax.sgd(0.1), input_key={"tokens": "tokens"})
    assert_one_line(error, "input_key={'tokens': 'tokens'}", "Tagger.__call__", "'tokens'")
    with pytest.raises(jddp.ConfigError) as error:
        jddp.Trainer(Tagger(), tagging_loss, optax.sgd(0.1), input_key=("tokens", 3))
    assert_one_line(error, "input_key must name", "('tokens', 3)")
    trainer = jddp.Trainer(Tagger(), tagging_loss, optax.sgd(0.1), input_key=TAGGER_INPUTS)
    batch = {k: v for k, v in tagging_batches(steps=1)[0].items() if k != "segments"}
    with pytest.raises(jddp.ShapeError) as error:
        trainer.init(seed=0, sample_batch=batch)
    assert_one_line(error, "no 'segments' entry", "input_key=")
