"""The library API: evaluation exactness, mixed precision, train-mode flags, typed errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp import losses
from jddp.trainer import MAX_STEPS_IN_FLIGHT, InFlightBound
from tests.helpers import assert_one_line


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


class DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(3)(x)


def random_data(n, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "image": rng.normal(size=(n, 6)).astype(np.float32),
        "label": rng.integers(0, 3, size=n).astype(np.int32),
    }


def make_trainer(model=None, num_devices=8, **kwargs):
    return jddp.Trainer(
        model or Net(),
        losses.softmax_cross_entropy,
        optax.adam(1e-2),
        metrics={"accuracy": losses.accuracy},
        devices=jax.devices()[:num_devices],
        **kwargs,
    )


@pytest.mark.parametrize("num_devices", [1, 8])
def test_evaluate_counts_ragged_batches_exactly_once(num_devices):
    examples = random_data(203)
    trainer = make_trainer(num_devices=num_devices)
    state = trainer.init(seed=0, sample_batch=examples)
    for _ in range(5):
        state, _ = trainer.step(state, random_data(64, seed=1))
    batches = [{k: v[i : i + 50] for k, v in examples.items()} for i in range(0, 203, 50)]
    result = trainer.evaluate(state, batches)  # sizes 50, 50, 50, 50, 3

    params = trainer.host_state(state).params  # reference: every example at once, on the host
    logits = Net().apply({"params": params}, examples["image"])
    expected_loss = optax.softmax_cross_entropy_with_integer_labels(logits, examples["label"])
    assert result["count"] == 203
    np.testing.assert_allclose(result["loss"], float(jnp.mean(expected_loss)), rtol=1e-5)
    expected_accuracy = np.mean(np.argmax(logits, -1) == examples["label"])
    np.testing.assert_allclose(result["accuracy"], expected_accuracy, rtol=1e-6)


def test_bfloat16_compute_keeps_float32_master_state():
    trainer = make_trainer(compute_dtype="bfloat16")
    state = trainer.init(seed=0, sample_batch=random_data(8))
    for _ in range(3):
        state, metrics = trainer.step(state, random_data(64))
    host = trainer.host_state(state)
    floats = [x for x in jax.tree.leaves((host.params, host.opt_state)) if x.dtype.kind == "f"]
    assert floats and all(x.dtype == np.float32 for x in floats)
    assert metrics["loss"].dtype == jnp.float32
    # bfloat16 compute really happened: the loss differs from a float32 run's.
    f32 = make_trainer()
    f32_state = f32.init(seed=0, sample_batch=random_data(8))
    _, f32_metrics = f32.step(f32_state, random_data(64))
    bf16 = make_trainer(compute_dtype="bfloat16")
    _, bf16_metrics = bf16.step(bf16.init(seed=0, sample_batch=random_data(8)), random_data(64))
    assert float(f32_metrics["loss"]) != float(bf16_metrics["loss"])
    np.testing.assert_allclose(float(bf16_metrics["loss"]), float(f32_metrics["loss"]), rtol=2e-2)


def test_train_flag_turns_dropout_on_in_training_only():
    trainer = make_trainer(DropoutNet())
    state = trainer.init(seed=0, sample_batch=random_data(8))
    batch = random_data(64)
    state, _ = trainer.step(state, batch)
    evals = [trainer.evaluate(state, [batch])["loss"] for _ in range(2)]
    assert evals[0] == evals[1]  # eval is deterministic: dropout off
    params = trainer.host_state(state).params
    logits = DropoutNet().apply({"params": params}, batch["image"], train=False)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    np.testing.assert_allclose(evals[0], float(expected), rtol=1e-5)
    # Training draws a fresh mask each step: the same batch twice gives different losses
    # even after a near-zero learning rate would leave the parameters unchanged.
    still = jddp.Trainer(DropoutNet(), losses.softmax_cross_entropy, optax.sgd(0.0))
    still_state = still.init(seed=0, sample_batch=batch)
    still_state, a = still.step(still_state, batch)
    still_state, b = still.step(still_state, batch)
    assert float(a["loss"]) != float(b["loss"])


def test_loss_must_be_per_example():
    def mean_loss(logits, batch):
        return losses.softmax_cross_entropy(logits, batch).mean()

    trainer = jddp.Trainer(Net(), mean_loss, optax.sgd(0.1))
    state = trainer.init(seed=0, sample_batch=random_data(8))
    with pytest.raises(
        jddp.ShapeError, match=r"loss must give one value per example.*got shape \(\)"
    ):
        trainer.step(state, random_data(64))


def test_global_batch_must_divide_over_devices_and_accumulation():
    trainer = make_trainer(grad_accum_steps=2)
    state = trainer.init(seed=0, sample_batch=random_data(8))
    with pytest.raises(jddp.ConfigError, match=r"global_batch_size=24 .* 8 x 2 = 16.* 16 or 32"):
        trainer.step(state, random_data(24))


def test_unknown_strategy_and_missing_input_are_typed_errors():
    with pytest.raises(jddp.ConfigError, match="unknown parallel.strategy 'zero7'.*ddp"):
        make_trainer(strategy="zero7")
    with pytest.raises(jddp.ConfigError, match="compute_dtype"):
        make_trainer(compute_dtype="float16x")
    with pytest.raises(jddp.ConfigError, match="grad_accum_steps"):
        make_trainer(grad_accum_steps=0)
    trainer = make_trainer(input_key="pixels")
    with pytest.raises(jddp.ShapeError, match=r"no 'pixels' entry \(keys: \['image', 'label'\]\)"):
        trainer.init(seed=0, sample_batch=random_data(8))


def test_library_misuse_is_a_one_line_typed_error():
    trainer = make_trainer()
    batch = random_data(16)
    with pytest.raises(jddp.UsageError) as error:
        trainer.step(None, batch)  # before init
    assert_one_line(error, "Trainer.step got NoneType, not a TrainState", "trainer.init(")
    with pytest.raises(jddp.UsageError) as error:
        trainer.evaluate({"params": {}}, [batch])
    assert_one_line(error, "Trainer.evaluate got dict")
    ragged = {**batch, "label": batch["label"][:12]}
    with pytest.raises(jddp.ShapeError) as error:
        trainer.place_batch(ragged)
    assert_one_line(error, "batch entry 'label' has leading size 12", "'image' has 16")
    with pytest.raises(jddp.ShapeError) as error:
        trainer.init(seed=0, sample_batch={**batch, "weight": np.float32(1.0)})
    assert_one_line(error, "batch entry 'weight' has leading size None")
    with pytest.raises(jddp.ConfigError) as error:
        jddp.Trainer(
            Net(),
            losses.softmax_cross_entropy,
            optax.sgd(0.1),
            metrics={"regularizer": losses.accuracy},
        )
    assert_one_line(error, "'regularizer' is reserved")


class Dispatched:
    """Stands for a step's output still being computed: pending until `block_until_ready`."""

    def __init__(self, pending: list):
        self.pending = pending
        pending.append(self)

    def block_until_ready(self):
        self.pending.remove(self)
        return self


def test_in_flight_bound_waits_for_the_oldest_beyond_its_limit():
    pending = []
    bound = InFlightBound(3)
    outputs = []
    for count in range(1, 8):
        outputs.append(Dispatched(pending))
        bound.add(outputs[-1])
        assert pending == outputs[max(0, count - 3) :]  # the newest 3: the oldest waited first


# (collectives, outstanding outputs after each of 8 steps): XLA:CPU's bound; none for native
@pytest.mark.parametrize(
    "collectives,outstanding", [("auto", [1, 2, 3, 4, 4, 4, 4, 4]), ("native", list(range(1, 9)))]
)
def test_steps_dispatched_without_reading_their_metrics_stay_at_most_four_in_flight_on_cpu(
    monkeypatch, collectives, outstanding
):
    """Training never reads its metrics here, so only the trainer's bound waits: on CPU (auto's
    choice there) after each step at most MAX_STEPS_IN_FLIGHT (4) steps' outputs are outstanding,
    and no fewer than that (it does not wait for every step); with native collectives the
    trainer never waits (the runtime bounds its own queue)."""
    trainer = make_trainer(num_devices=1, collectives=collectives)
    state = trainer.init(seed=0, sample_batch=random_data(8))
    pending, train_step = [], trainer.strategy.train_step

    def recorded(state, batch):
        state, metrics = train_step(state, batch)
        return state, {**metrics, "loss": Dispatched(pending)}

    monkeypatch.setattr(trainer.strategy, "train_step", recorded)
    seen = []
    for _ in range(8):
        state, _ = trainer.step(state, random_data(8))
        seen.append(len(pending))
    assert MAX_STEPS_IN_FLIGHT == 4
    assert trainer.collectives == {"auto": "cpu"}.get(collectives, collectives)
    assert seen == outstanding


def test_init_takes_a_seed_or_a_key_and_refuses_anything_else_in_one_line():
    data = {"image": np.ones((8, 4), np.float32), "label": np.zeros(8, np.int32)}
    trainer = jddp.Trainer(nn.Dense(3), _label_loss, optax.sgd(0.1))
    from_int = trainer.host_state(trainer.init(3, data)).params
    for key in (jax.random.key(3), jax.random.PRNGKey(3)):
        from_key = trainer.host_state(trainer.init(key, data)).params
        jax.tree.map(np.testing.assert_array_equal, from_key, from_int)
    other = trainer.host_state(trainer.init(4, data)).params
    assert not np.array_equal(other["kernel"], from_int["kernel"])
    for bad in (-1, 1.5, "0", True, jax.random.split(jax.random.key(0))):
        with pytest.raises(jddp.UsageError) as raised:
            trainer.init(bad, data)
        assert_one_line(raised, "seed must be a non-negative integer or a JAX key")


def _label_loss(outputs, batch):
    return optax.softmax_cross_entropy_with_integer_labels(outputs, batch["label"])
