"""The independent references every equivalence test compares with: a plain single-device
`jax.jit` + optax loop that shares nothing with jddp but the model, optimizer and initial
parameters, plus the small model and batches those tests train, and tolerance checks."""

import hashlib

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx

# assert_trees_close's absolute floors, in units of rtol x a tensor's largest entry. A signed tensor
# (parameters, Adam's first moment) has entries near zero that are differences of large terms:
# summed in another order (other devices, other shards) they carry rounding errors of the large
# ones' size. Measured on the tiny GPT's layouts after 20 steps: up to 1.9e-6 of the tensor's
# largest entry (biases and first moments of biases), elsewhere every entry within 1e-5 of its
# own value. A tensor with no negative entry (Adam's second moment, a LayerNorm scale) has no
# such cancellation: each entry is held to 1e-5 of itself (seen: within 1.2e-15 of the largest).
FLOOR = 0.5
NONNEGATIVE_FLOOR = 1e-7

GLOBAL_BATCH = 32
STEPS = 20


class SmallNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(24)(x.reshape(x.shape[0], -1)))
        return nn.Dense(5)(x)


def per_example_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


class TensorNet(nn.Module):
    """A user's module written with no thought of tensor parallelism; `TENSOR_RULES` give it
    Megatron's layout (fc split by columns, proj by rows)."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(32, name="fc")(x.reshape(x.shape[0], -1)))
        y = nn.LayerNorm(name="ln")(nn.Dense(16, name="proj")(h))
        return nn.Dense(5, name="head")(y)


class EvenNet(nn.Module):
    """Every kernel divides by 8 devices on each dimension, into slices far above
    `jddp.observe.hlo`'s scalar filter, and there are no biases: ZeRO's byte formulas hold
    exactly."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256, use_bias=False)(x.reshape(x.shape[0], -1)))
        x = nn.relu(nn.Dense(256, use_bias=False)(x))
        return nn.Dense(64, use_bias=False)(x)


EVEN_PARAMS = 12 * 256 + 256 * 256 + 256 * 64


class NnxTensorNet(nnx.Module):
    """TensorNet written in NNX, with the same parameter names."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(12, 32, rngs=rngs)
        self.proj = nnx.Linear(32, 16, rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        h = nnx.gelu(self.fc(x.reshape(x.shape[0], -1)))
        return self.head(self.ln(self.proj(h)))


TENSOR_RULES = (("fc/kernel", "fsdp,tensor"), ("fc/bias", "tensor"), ("proj/kernel", "tensor,fsdp"))


def make_batches(seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.normal(size=(GLOBAL_BATCH, 4, 3)).astype(np.float32),
            "label": rng.integers(0, 5, size=(GLOBAL_BATCH,)).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


def reference_training(params, optimizer, batches, model=None):
    """Single device: mean cross-entropy over the whole global batch, one optax update per batch
    (of SmallNet, or of `model`, a Linen module)."""
    model = model or SmallNet()

    def loss_fn(params, model_state, batch):
        logits = model.apply({"params": params}, batch["image"])
        return per_example_ce(logits, batch).mean(), model_state

    params, _, losses = plain_training(loss_fn, params, {}, optimizer, batches)
    return params, losses


def plain_training(loss_fn, params, model_state, optimizer, batches, with_opt_state=False):
    """One optax update per batch on one device. `loss_fn(params, model_state, batch)` returns
    (mean loss over the whole batch, updated model_state). Returns (params, model_state, losses),
    and the optimizer state last if `with_opt_state`."""

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
    result = jax.device_get(params), jax.device_get(model_state), losses
    return (*result, jax.device_get(opt_state)) if with_opt_state else result


def batchnorm_classifier_loss(model):
    """`loss_fn` for `plain_training` of a Linen classifier with BatchNorm on one device: mean
    cross-entropy, statistics over the whole batch, updated `batch_stats`."""

    def loss_fn(params, model_state, batch):
        logits, updated = model.apply(
            {"params": params, **model_state}, batch["image"], train=True, mutable=["batch_stats"]
        )
        return per_example_ce(logits, batch).mean(), updated

    return loss_fn


def assert_trees_close(actual, expected, rtol=1e-5, signed=False):
    """Each entry of each tensor within `rtol` of the reference's entry, plus an absolute floor:
    FLOOR x rtol x the tensor's largest entry where it has entries of both signs (see FLOOR),
    or where `signed` says its entries are sums of updates of either sign that happen to be
    positive (a scale that starts at zero), NONNEGATIVE_FLOOR x rtol x that where it has none
    below zero."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(expected)]
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves), (len(actual_leaves), len(expected_leaves))
    for path, a, e in zip(paths, actual_leaves, expected_leaves, strict=True):
        e = np.asarray(e)
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        floor = NONNEGATIVE_FLOOR if not signed and (e.size == 0 or e.min() >= 0) else FLOOR
        np.testing.assert_allclose(a, e, rtol=rtol, atol=floor * rtol * scale, err_msg=path)


def assert_optimizer_states_close(actual, expected, rtol=1e-5):
    """`assert_trees_close` for optimizer states, Adam's second moments (`nu`) compared by their
    square roots as signed tensors. An entry of `nu` is a mean of squared gradients; a gradient
    near zero is a difference of large terms whose rounding error is of the size of the tensor's
    largest gradient (FLOOR), and squaring makes that a relative error of any size (seen: 1.6e-5
    on an entry of 1.3e-10, the tensor's largest 8e-9). Its square root, a root mean square
    gradient, carries the gradient's own error."""

    def moments(tree):
        is_nu = lambda path: any(getattr(k, "name", None) == "nu" for k in path)  # noqa: E731
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        rms = {jax.tree_util.keystr(p): np.sqrt(x) for p, x in leaves if is_nu(p)}
        rest = {jax.tree_util.keystr(p): x for p, x in leaves if not is_nu(p)}
        return rms, rest

    (actual_rms, actual_rest), (expected_rms, expected_rest) = map(moments, (actual, expected))
    assert_trees_close(actual_rest, expected_rest, rtol)
    assert_trees_close(actual_rms, expected_rms, rtol, signed=True)


CLIP_NORM = 0.5


def optimizer_for(clip: bool):
    adam = optax.adam(3e-3)
    return optax.chain(optax.clip_by_global_norm(CLIP_NORM), adam) if clip else adam


def train_and_compare(trainer, optimizer, batches, reference=reference_training) -> list[float]:
    """Trains `trainer` on `batches` from its own initial parameters, checks parameters and
    per-step losses against `reference` (`reference_training` or one of its signature) from the
    same start; returns the grad norms."""
    state = trainer.init(seed=0, sample_batch=batches[0])
    initial = trainer.host_state(state).params
    losses, grad_norms = [], []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    expected_params, expected_losses = reference(initial, optimizer, batches)
    final = trainer.host_state(state)
    assert_trees_close(final.params, expected_params)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert int(final.step) == len(batches)
    return grad_norms


def assert_replicas_identical(tree):
    """Every device's copy of every leaf is bit-identical to the first device's."""
    for leaf in jax.tree.leaves(tree):
        replicas = [np.asarray(shard.data) for shard in leaf.addressable_shards]
        for replica in replicas[1:]:
            np.testing.assert_array_equal(replica, replicas[0])


_COMPUTED = {}


def computed_once(compute, *inputs):
    """`compute(*inputs)`, computed once per test process for inputs of the same structure and
    values (a hash of their leaves): the parametrized cases of a layout test share one
    single-device reference. `compute` is a named function whose result depends on `inputs`
    alone."""
    hashed = hashlib.sha256(str(jax.tree.structure(inputs)).encode())
    for leaf in jax.tree.leaves(inputs):
        hashed.update(np.ascontiguousarray(leaf).tobytes())
    key = (compute.__module__, compute.__qualname__, hashed.hexdigest())
    if key not in _COMPUTED:
        _COMPUTED[key] = compute(*inputs)
    return _COMPUTED[key]
