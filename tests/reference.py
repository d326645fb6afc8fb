"""Independent references for the model tests: a plain single-device `jax.jit` + optax loop that
shares nothing with jddp, and a tolerance check for parameter trees."""

import jax
import numpy as np
import optax


def plain_training(loss_fn, params, model_state, optimizer, batches):
    """One optax update per batch on one device. `loss_fn(params, model_state, batch)` returns
    (mean loss over the whole batch, updated model_state). Returns (params, model_state, losses)."""

    @jax.jit
    def step(params, model_state, opt_state, batch):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, model_state), grads = grad_fn(params, model_state, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), model_state, opt_state, loss

    opt_state = optimizer.init(params)
    losses = []
    for batch in batches:
        params, model_state, opt_state, loss = step(params, model_state, opt_state, batch)
        losses.append(float(loss))
    return jax.device_get(params), jax.device_get(model_state), losses


def batchnorm_classifier_loss(model):
    """`loss_fn` for `plain_training` of a Linen classifier with BatchNorm on one device: mean
    cross-entropy, statistics over the whole batch, updated `batch_stats`."""

    def loss_fn(params, model_state, batch):
        logits, updated = model.apply(
            {"params": params, **model_state}, batch["image"], train=True, mutable=["batch_stats"]
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return ce, updated

    return loss_fn


def assert_trees_close(actual, expected, rtol=1e-5):
    """Each tensor within `rtol` of the reference, relative to the tensor's largest entry."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(expected)]
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves), (len(actual_leaves), len(expected_leaves))
    for path, a, e in zip(paths, actual_leaves, expected_leaves, strict=True):
        scale = np.max(np.abs(e))
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=path)


def assert_replicas_identical(tree):
    """Every device's copy of every leaf is bit-identical to the first device's."""
    for leaf in jax.tree.leaves(tree):
        replicas = [np.asarray(shard.data) for shard in leaf.addressable_shards]
        for replica in replicas[1:]:
            np.testing.assert_array_equal(replica, replicas[0])
