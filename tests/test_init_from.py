"""Starting from weights a user already has: parameters, BatchNorm statistics and optimizer
state from a Flax-example-style run go into any strategy's state and training continues exactly
as the Flax loop continues; `init_from` finds parameters and batch statistics by name in
checkpoints written with flax.training.checkpoints (orbax or msgpack) and orbax's manager."""

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import checkpoints as flax_checkpoints
from flax.training import train_state

import jddp
import jddp.checkpoints.weights
from experiments.configs import digits_mlp
from jddp import data
from jddp.checkpoints.newest import NewestCheckpoint
from jddp.errors import CheckpointError
from jddp.run import optim, resume
from jddp.run.factory import build_trainer
from tests.helpers import assert_one_line, train_steps
from tests.reference import assert_trees_close, per_example_ce


class ExampleNet(nn.Module):
    """Shaped like the Flax examples' models: `train` switches BatchNorm's statistics."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16, use_bias=False)(x.reshape(len(x), -1))  # BatchNorm brings the bias
        axis_name = self.axis_name if train else None
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8, axis_name=axis_name)(x)
        return nn.Dense(5)(nn.relu(x))


class ExampleState(train_state.TrainState):  # the Flax ImageNet example's TrainState
    batch_stats: Any


def example_step(state, batch):
    """The Flax examples' train step, on one device: mean loss, updated statistics."""

    def loss_fn(params):
        logits, updated = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            train=True,
            mutable=["batch_stats"],
        )
        return per_example_ce(logits, batch).mean(), updated["batch_stats"]

    grads, batch_stats = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats)


def example_batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "image": (rng.normal(size=(16, 4, 3)) * 2 + 1).astype(np.float32),
            "label": rng.integers(0, 5, size=16).astype(np.int32),
        }
        for _ in range(steps)
    ]


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_weights_statistics_and_optimizer_state_continue_a_flax_run(strategy):
    optimizer = optax.sgd(0.1, momentum=0.9)
    batches = example_batches(6)
    variables = ExampleNet().init(jax.random.key(0), batches[0]["image"], train=False)
    flax_state = ExampleState.create(
        apply_fn=ExampleNet().apply,
        params=variables["params"],
        tx=optimizer,
        batch_stats=variables["batch_stats"],
    )
    step = jax.jit(example_step)
    for batch in batches[:3]:  # the user's run so far
        flax_state = step(flax_state, batch)
    resumed_here = flax_state
    for batch in batches[3:]:  # the reference: the Flax loop going on
        flax_state = step(flax_state, batch)

    model = ExampleNet(axis_name=jddp.batch_axis_name(strategy))
    options = {"min_shard_size": 1} if strategy != "ddp" else {}
    trainer = jddp.Trainer(model, per_example_ce, optimizer, strategy=strategy, **options)
    state = trainer.init(seed=1, sample_batch=batches[0])
    state = trainer.replace_state(
        state,
        params=jax.device_get(resumed_here.params),
        model_state={"batch_stats": jax.device_get(resumed_here.batch_stats)},
        opt_state=jax.device_get(resumed_here.opt_state),  # a tuple of optax states
    )
    state, _ = train_steps(trainer, state, batches[3:])
    final = trainer.host_state(state)
    assert_trees_close(final.params, jax.device_get(flax_state.params))
    assert_trees_close(final.model_state["batch_stats"], jax.device_get(flax_state.batch_stats))
    with pytest.raises(jddp.ShapeError, match="params has no 'BatchNorm_0/bias'"):
        trainer.replace_state(state, params={"Dense_0": resumed_here.params["Dense_0"]})


# ------------------------------------------------------------------ init_from a Flax checkpoint
def resnet_config(width=2, init_from=""):
    config = digits_mlp.get_config()
    config.model = "resnet"
    config.model_args = {"depth": 18, "stem": "cifar", "width": width}
    config.global_batch_size, config.init_from = 16, init_from
    return config


def example_checkpoint(directory, writer, width=2):
    """A Flax example's checkpoint of jddp's ResNet (its TrainState as a dict: step, params,
    opt_state, batch_stats), written as `writer` writes them; returns the saved trees."""
    model = jddp.models.create_model("resnet", 10, **resnet_config(width).model_args)
    init = functools.partial(model.init, train=False)
    shapes = jax.eval_shape(init, jax.random.key(0), jnp.ones((1, 8, 8, 1)))
    rng = np.random.default_rng(0)
    saved = jax.tree.map(  # values unlike any initialization, statistics included
        lambda x: rng.normal(size=x.shape).astype(np.float32), dict(shapes)
    )
    tx = optax.sgd(0.1, momentum=0.9)
    state = {"step": 7, "params": saved["params"], "opt_state": tx.init(saved["params"])}
    state["batch_stats"] = saved["batch_stats"]
    if writer == "orbax manager":
        with ocp.CheckpointManager(directory) as manager:
            manager.save(7, args=ocp.args.StandardSave(state))
    else:
        use_orbax = writer == "flax checkpoints (orbax)"
        with flax.config.temp_flip_flag("use_orbax_checkpointing", use_orbax):
            flax_checkpoints.save_checkpoint(directory, state, step=7)
    return saved


WRITERS = ("flax checkpoints (orbax)", "flax checkpoints (msgpack)", "orbax manager")


def test_init_from_finds_parameters_and_batch_statistics_by_name(tmp_path):
    dataset = data.get_dataset("digits")
    splits = data.open_dataset(dataset)
    sample = splits.sample_batch()
    batches = data.train_batches(splits.train, splits.transform, global_batch_size=16, seed=0)
    state = trainer = None
    for writer in WRITERS:
        folder = str(tmp_path / writer.replace(" ", "_"))
        saved = example_checkpoint(folder, writer)
        config = resnet_config(init_from=folder)
        trainer = trainer or build_trainer(config, dataset, optim.learning_rate_schedule(config))
        newest = NewestCheckpoint.read(str(tmp_path / "run"))
        start = resume.check_before_start(newest, config, trainer, sample, batches)
        assert start.resume_step is None
        if state is None:  # the whole start, as train_and_evaluate makes it, once
            state = resume.fresh_state(trainer, config, sample)
        else:  # its loading and placing, for the other writers (initializing is the slow part)
            weights = jddp.checkpoints.weights.load_weights(folder)
            params, model_state = weights.params, weights.model_state
            state = trainer.replace_state(state, params=params, model_state=model_state)
        host = trainer.host_state(state)
        assert int(host.step) == 0, writer  # the run's own step, not the saved 7
        jax.tree.map(np.testing.assert_array_equal, host.params, saved["params"])
        expected_model_state = {"batch_stats": saved["batch_stats"]}
        jax.tree.map(np.testing.assert_array_equal, host.model_state, expected_model_state)


def test_init_from_a_flax_checkpoint_of_another_model_is_refused_before_any_write(tmp_path):
    example_checkpoint(str(tmp_path / "flax"), "flax checkpoints (orbax)", width=4)
    config = resnet_config(init_from=str(tmp_path / "flax"))
    dataset = data.get_dataset("digits")
    trainer = build_trainer(config, dataset, optim.learning_rate_schedule(config))
    sample = data.open_dataset(dataset).sample_batch()
    with pytest.raises(CheckpointError) as error:
        newest = NewestCheckpoint.read(str(tmp_path / "run"))
        resume.check_before_start(newest, config, trainer, sample, None)
    assert_one_line(error, "head/kernel", "(32, 10) in init_from", "(16, 10) in the model")
    assert not (tmp_path / "run").exists()
