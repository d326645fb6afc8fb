"""The loss / gradient / update core that every strategy shares.

Nothing here places data or talks to other devices: a strategy wraps these pure functions with its
placement (pmap replicas, mesh shardings) and its collectives (pmean, reduce-scatter, all-gather).
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jddp.errors import ConfigError, ShapeError
from jddp.modules import as_functional
from jddp.state import TrainState

Batch = Mapping[str, jax.Array]
# (model outputs, batch) -> one value per example, shape (batch,). Losses and metrics alike: the
# core takes means for training and masked sums for evaluation, so padding never biases a metric.
PerExampleFn = Callable[[Any, Batch], jax.Array]

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype_of(name: str):
    if name not in COMPUTE_DTYPES:
        raise ConfigError(
            f"unknown compute_dtype {name!r}; choose one of {', '.join(COMPUTE_DTYPES)}"
        )
    return COMPUTE_DTYPES[name]


def _cast_floats(tree, dtype):
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """What to train: a Flax module (Linen or NNX), a per-example loss on its outputs, an optax
    optimizer.

    Parameters and optimizer state stay float32; with `compute_dtype=bfloat16` parameters and
    inputs are cast on the way into the model (activations and matmuls in bfloat16) and outputs
    cast back to float32 before the loss, so gradients arrive in float32.
    If the module's `__call__` takes `train`, it gets `train=True` in training and `False` in eval.
    BatchNorm statistics: with `grad_accum_steps` > 1 they are those of each micro-batch (as in
    PyTorch), and running averages are updated once per micro-batch.
    """

    model: Any  # a flax.linen.Module or a flax.nnx.Module instance (see jddp/modules.py)
    loss_fn: PerExampleFn
    optimizer: optax.GradientTransformation
    metrics: Mapping[str, PerExampleFn] = dataclasses.field(default_factory=dict)
    input_key: str = "image"
    compute_dtype: Any = jnp.float32
    grad_accum_steps: int = 1
    log_grad_norm: bool = True
    skip_nonfinite: bool = False
    # (params, key) -> the strategy's gradient-communication state (PowerSGD's), like the
    # optimizer's; None: an empty dict.
    init_comm_state: Callable[[Any, jax.Array], Any] | None = None

    def __post_init__(self):
        if not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise ConfigError(
                f"grad_accum_steps must be a positive integer, got {self.grad_accum_steps!r}"
            )
        if "loss" in self.metrics:
            raise ConfigError("'loss' is reserved for loss_fn; give the metric another name")
        # Linen and NNX modules alike, as init -> (params, model_state) and apply.
        object.__setattr__(self, "_module", as_functional(self.model))

    # ----------------------------------------------------------------------------- init
    def init_state(self, seed_key: jax.Array, sample_input: jax.Array) -> TrainState:
        """A fresh state from a PRNG key and one example input (its batch size does not matter)."""
        params_key, dropout_key, step_key = jax.random.split(seed_key, 3)
        params, model_state = self._module.init(
            {"params": params_key, "dropout": dropout_key}, sample_input
        )
        comm_state = None
        if self.init_comm_state is not None:
            comm_state = self.init_comm_state(params, jax.random.fold_in(seed_key, 1))
        return TrainState.create(
            params=params,
            opt_state=self.optimizer.init(params),
            model_state=model_state,
            rng=jax.random.key_data(step_key),
            comm_state=comm_state,
        )

    # -------------------------------------------------------------------------- forward
    def forward(self, params, model_state, batch: Batch, *, train: bool, rng=None):
        """Model outputs in float32 and the updated mutable collections."""
        outputs, model_state = self._module.apply(
            _cast_floats(params, self.compute_dtype),
            model_state,
            _cast_floats(batch[self.input_key], self.compute_dtype),
            train=train,
            rng=rng,
        )
        return _cast_floats(outputs, jnp.float32), model_state

    def per_example(self, outputs, batch: Batch) -> dict[str, jax.Array]:
        """`loss` and every metric, one value per example."""
        batch_size = batch[self.input_key].shape[0]
        values = {"loss": self.loss_fn(outputs, batch)}
        values.update({name: fn(outputs, batch) for name, fn in self.metrics.items()})
        for name, value in values.items():
            if jnp.shape(value) != (batch_size,):
                raise ShapeError(
                    f"{name} must give one value per example, shape ({batch_size},), "
                    f"got shape {jnp.shape(value)}; return per-example values, not their mean"
                )
        return values

    # ------------------------------------------------------------------------- gradients
    def _micro_grads(self, params, model_state, batch, rng, params_fn):
        def mean_loss(params):
            outputs, new_model_state = self.forward(
                params_fn(params), model_state, batch, train=True, rng=rng
            )
            values = self.per_example(outputs, batch)
            means = {name: jnp.mean(v.astype(jnp.float32)) for name, v in values.items()}
            return means["loss"], (means, new_model_state)

        (_, (metrics, model_state)), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
        return grads, metrics, model_state

    def local_grads(self, params, model_state, batch: Batch, rng: jax.Array, params_fn=None):
        """Mean gradient and metrics over `batch`, summed over `grad_accum_steps` micro-batches.

        No collective of its own: a strategy reduces the result across devices once per step.
        `params_fn` maps the state's parameters to the ones the model uses (ZeRO-3 gathers its
        shards there); gradients are taken with respect to `params`.
        """
        params_fn = params_fn or (lambda params: params)
        steps = self.grad_accum_steps
        if steps == 1:
            return self._micro_grads(params, model_state, batch, rng, params_fn)
        size = batch[self.input_key].shape[0]
        if size % steps:
            raise ShapeError(
                f"a device's batch of {size} examples does not split into {steps} micro-batches; "
                "make global_batch_size divisible by devices x grad_accum_steps"
            )
        micro_batches = jax.tree.map(lambda x: x.reshape(steps, size // steps, *x.shape[1:]), batch)

        def accumulate(carry, inputs):
            grad_sum, metric_sum, model_state = carry
            index, micro_batch = inputs
            grads, metrics, model_state = self._micro_grads(
                params, model_state, micro_batch, jax.random.fold_in(rng, index), params_fn
            )
            add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
            return (add(grad_sum, grads), add(metric_sum, metrics), model_state), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        metric_zeros = {name: jnp.zeros((), jnp.float32) for name in ("loss", *self.metrics)}
        (grad_sum, metric_sum, model_state), _ = jax.lax.scan(
            accumulate,
            (zeros, metric_zeros, model_state),
            (jnp.arange(steps), micro_batches),
        )
        mean = lambda tree: jax.tree.map(lambda x: x / steps, tree)  # noqa: E731
        return mean(grad_sum), mean(metric_sum), model_state

    # ---------------------------------------------------------------------------- update
    def apply_gradients(self, state: TrainState, grads, model_state, metrics, comm_state=None):
        """The optimizer update with already-averaged gradients (and the strategy's next
        `comm_state`, kept or dropped with the update; None: unchanged).

        Counts a step whose loss (or gradient norm, when computed) is not finite in
        `nonfinite_steps`; with `skip_nonfinite` such a step leaves parameters, optimizer state and
        mutable collections as they were, on every device alike (the decision is made on the
        averaged values). Adds `grad_norm` to metrics when `log_grad_norm`: one more pass over the
        gradients, shared with clipping when the optimizer clips.
        """
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        comm_state = state.comm_state if comm_state is None else comm_state
        updated = (optax.apply_updates(state.params, updates), opt_state, model_state, comm_state)
        finite = jnp.isfinite(metrics["loss"])
        if self.log_grad_norm or self.skip_nonfinite:
            grad_norm = optax.global_norm(grads)
            finite &= jnp.isfinite(grad_norm)
            if self.log_grad_norm:
                metrics = {**metrics, "grad_norm": grad_norm}
        if self.skip_nonfinite:
            kept = (state.params, state.opt_state, state.model_state, state.comm_state)
            updated = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, kept)
        params, opt_state, model_state, comm_state = updated
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
            comm_state=comm_state,
        )
        return new_state, metrics

    # ------------------------------------------------------------------------------ eval
    def eval_sums(self, params, model_state, batch: Batch) -> dict[str, jax.Array]:
        """Sums of loss and metrics over the examples whose `mask` is 1, and their `count`."""
        outputs, _ = self.forward(params, model_state, batch, train=False)
        mask = batch["mask"].astype(jnp.float32)
        sums = {
            name: jnp.sum(value.astype(jnp.float32) * mask)
            for name, value in self.per_example(outputs, batch).items()
        }
        return {**sums, "count": jnp.sum(mask)}


def check_divisible(global_batch_size: int, num_devices: int, grad_accum_steps: int) -> int:
    """The per-device micro-batch size, or a ConfigError naming the sizes that do not divide."""
    parts = num_devices * grad_accum_steps
    if global_batch_size < 1 or global_batch_size % parts:
        below = global_batch_size // parts * parts
        nearest = " or ".join(str(n) for n in (below, below + parts) if n > 0)
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not divisible by devices x grad_accum_steps "
            f"= {num_devices} x {grad_accum_steps} = {parts}; use a multiple of {parts}, "
            f"e.g. {nearest}"
        )
    return global_batch_size // parts


def check_rows_divide(rows: int, parts: int) -> None:
    """A ShapeError unless a batch of `rows` examples splits evenly into `parts` slices."""
    if rows % parts:
        raise ShapeError(
            f"a batch of {rows} examples does not split over {parts} devices; "
            f"use a multiple of {parts}"
        )


def init_compiler_options() -> dict | None:
    """XLA options for programs that run once, such as initialization: on CPU, no LLVM
    optimization. Optimizing threefry's random-number kernels costs seconds per parameter tensor
    on CPU (a small ResNet-18's init: 55 s to compile, 6 s without); the unoptimized program
    runs in milliseconds to seconds."""
    return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None


def jit_init(fn, *args, **jit_kwargs):
    """`jax.jit(fn, **jit_kwargs)(*args)`, compiled with `init_compiler_options()`."""
    return jax.jit(fn, **jit_kwargs).lower(*args).compile(init_compiler_options())(*args)
