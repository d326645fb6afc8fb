"""The loss / gradient / update core that every strategy shares.

Nothing here places data or talks to other devices: a strategy wraps these pure functions with its
placement (pmap replicas, mesh shardings) and its collectives (pmean, reduce-scatter, all-gather).
"""

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jddp.core import layer_stacks, lora, row_keys, sown
from jddp.core.layer_stacks import Stack, finding_stacks
from jddp.core.lora import LoRA
from jddp.core.loss_scale import DynamicLossScale
from jddp.core.modules import ModelInputs, as_functional
from jddp.core.slices import Slices
from jddp.core.state import TrainState
from jddp.core.weighted import PerExampleFn, Totals, masked_sums, weighted_values
from jddp.errors import ConfigError, ShapeError, UsageError

Batch = Mapping[str, jax.Array]
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def compute_dtype_of(name: str):
    if name not in COMPUTE_DTYPES:
        raise ConfigError(
            f"unknown compute_dtype {name!r}; choose one of {', '.join(COMPUTE_DTYPES)}"
        )
    return COMPUTE_DTYPES[name]


def cast_floats(tree, dtype):
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """What to train: a Flax module (Linen or NNX), a per-example loss on its outputs, an optax
    optimizer (of the trainable parameters, `trainable`: with `lora` the adapters alone).

    Parameters and optimizer state stay float32; with `compute_dtype` bfloat16 or float16
    parameters and inputs are cast on the way into the model (activations and matmuls in that
    type) and outputs cast back to float32 before the loss, so gradients arrive in float32.
    float16 also scales the loss (`loss_scaling`, default `DynamicLossScale()`).
    `input_key` names the model's inputs (`jddp.core.modules.ModelInputs`); `train` /
    `deterministic` / NNX `rngs` arguments of `__call__` are filled in (jddp/core/modules.py).
    Loss and metrics are means over the global batch, weighted where `weight_key` names a batch
    entry of per-example weights or a function returns (weighted sums, weights) per example:
    sum(w * l) / sum(w) over the whole global batch, whatever the device count and accumulation.
    `regularizer(params) -> scalar` is added to the training loss (not to the `loss` metric, which
    stays comparable with eval; it is logged as `regularizer`). What a Linen model sows in
    training (jddp/core/sown.py: a mixture of experts' auxiliary losses and its experts' load)
    is added to the training loss, or logged, the same way.
    BatchNorm statistics: with `grad_accum_steps` > 1 they are those of each micro-batch (as in
    PyTorch), and running averages are updated once per micro-batch.
    """

    model: Any  # a flax.linen.Module or a flax.nnx.Module instance (see jddp/core/modules.py)
    loss_fn: PerExampleFn
    optimizer: optax.GradientTransformation
    metrics: Mapping[str, PerExampleFn] = dataclasses.field(default_factory=dict)
    input_key: str | Sequence[str] | Mapping[str, str] = "image"
    compute_dtype: Any = jnp.float32
    grad_accum_steps: int = 1
    log_grad_norm: bool = True
    skip_nonfinite: bool = False
    regularizer: Callable[[Any], jax.Array] | None = None
    weight_key: str | None = None
    loss_scaling: DynamicLossScale | None = None  # None: DynamicLossScale() for float16
    # Axis names the model uses -> the strategy's axes they mean ({"batch": ("data", "fsdp")}).
    axis_aliases: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # (params, key) -> the strategy's gradient-communication state (PowerSGD's), like the
    # optimizer's; None: an empty dict.
    init_comm_state: Callable[[Any, jax.Array], Any] | None = None
    # Where the model's `Pipelined` stack of layers is (None: it has none), as `abstract_state`
    # returns it; a strategy that pipelines takes a task with it set (`dataclasses.replace`).
    stack: Stack | None = None
    # Low-rank adapters on a frozen base (jddp/core/lora.py); None: every parameter trains.
    lora: LoRA | None = None

    def __post_init__(self):
        if not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise ConfigError(
                f"grad_accum_steps must be a positive integer, got {self.grad_accum_steps!r}"
            )
        reserved = {"loss", "regularizer", "grad_norm", "loss_scale"} & set(self.metrics)
        if reserved:
            raise ConfigError(
                f"metric name {sorted(reserved)[0]!r} is reserved for jddp's own; give the "
                "metric another name"
            )
        if self.regularizer is not None and not callable(self.regularizer):
            raise ConfigError(
                f"regularizer must be a function of the parameters, got {self.regularizer!r}"
            )
        scaling = self.loss_scaling
        if scaling is None and self.compute_dtype == jnp.float16:
            scaling = DynamicLossScale()
        object.__setattr__(self, "loss_scaling", scaling)
        if self.lora:
            self.lora.check_adaptable(self.model)
        # Linen and NNX modules alike, as init -> (params, model_state) and apply.
        object.__setattr__(self, "_module", as_functional(self.model, self.axis_aliases))
        object.__setattr__(self, "inputs", ModelInputs.parse(self.input_key))
        self.inputs.check_fits(self.model)

    # ----------------------------------------------------------------------------- init
    def abstract_state(self, sample_inputs) -> tuple[TrainState, Stack | None]:
        """(the state's shapes and dtypes, where the model's `Pipelined` stack of layers is or
        None), from the model's inputs for one example; nothing is computed."""
        found = []

        def init(key, inputs):
            state, stack = self._init(key, inputs)
            found.append(stack)
            return state

        shapes = jax.eval_shape(init, jax.random.key(0), sample_inputs)
        return shapes, found[0]

    def init_state(self, seed_key: jax.Array, sample_inputs) -> TrainState:
        """A fresh state from a PRNG key and the model's inputs for one example (a batch holding
        the entries `input_key` names, or the one input array itself; its batch size does not
        matter)."""
        return self._init(seed_key, sample_inputs)[0]

    def _init(self, seed_key: jax.Array, sample_inputs) -> tuple[TrainState, Stack | None]:
        """(a fresh state, where the model's `Pipelined` stack is or None)."""
        params_key, dropout_key, step_key = jax.random.split(seed_key, 3)
        args, kwargs = self._call_args(sample_inputs)
        with finding_stacks() as stacks, self.adapting(train=False):
            params, model_state = self._module.init(
                {"params": params_key, "dropout": dropout_key}, args, kwargs
            )
        if len(stacks) > 1:
            raise ConfigError(
                "a model may hold one jddp.parallel.pipeline.Pipelined stack, not several"
            )
        if stacks and getattr(self.model, "scan_layers", False) is True:
            # Stacked layers are a layout, not another model: initialize the unrolled twin
            # (layers block_i/...) and stack it, so the same seed gives the same parameters.
            # Under jit the stacked initialization above only told where the stack is.
            unrolled = as_functional(self.model.clone(scan_layers=False), self.axis_aliases)
            with self.adapting(train=False):
                variables = unrolled.init(
                    {"params": params_key, "dropout": dropout_key}, args, kwargs
                )
            params, model_state = layer_stacks.to_stacked(variables)
        if self.lora:
            self.lora.check_found(params)
        comm_state = None
        if self.init_comm_state is not None:
            comm_state = self.init_comm_state(
                self.trainable(params), jax.random.fold_in(seed_key, 1)
            )
        state = TrainState.create(
            params=params,
            opt_state=self.optimizer.init(self.trainable(params)),
            model_state=model_state,
            rng=jax.random.key_data(step_key),
            loss_scale=self.loss_scaling.init() if self.loss_scaling else None,
            comm_state=comm_state,
        )
        return state, stacks[0] if stacks else None

    # -------------------------------------------------------------------------- forward
    def _call_args(self, inputs) -> tuple[tuple, dict]:
        """The model's call arguments from a batch, or from its one input array itself."""
        if not isinstance(inputs, Mapping):
            if len(self.inputs.entries) != 1:
                raise ShapeError(
                    f"the model takes the batch entries {list(self.inputs.entries)}: pass a "
                    "batch holding them, not one array"
                )
            inputs = {self.inputs.entries[0]: inputs}
        return self.inputs.call_args(inputs)

    def batch_rows(self, batch: Batch) -> int:
        """How many examples `batch` holds (the first model input's leading size)."""
        return batch[self.inputs.entries[0]].shape[0]

    def slice_key(self, step_key: jax.Array, index, batch: Batch) -> jax.Array:
        """The step's key for the `index`-th equal slice of the global batch, `batch`: its
        examples draw what they would on one device (jddp/core/row_keys.py)."""
        rows = self.batch_rows(batch)
        return row_keys.batch_key(step_key, index * rows, rows)

    def forward(self, params, model_state, batch: Batch, *, train: bool, rng=None):
        """Model outputs in float32 and the updated mutable collections."""
        return self._forward_sown(params, model_state, batch, train=train, rng=rng)[:2]

    def _forward_sown(self, params, model_state, batch: Batch, *, train: bool, rng=None):
        """`forward`'s results and what the model sowed (jddp/core/sown.py)."""
        args, kwargs = self._call_args(cast_floats(self.model_inputs(batch), self.compute_dtype))
        with self.adapting(train):
            outputs, model_state, reports = self._module.apply_sown(
                cast_floats(self.frozen(params), self.compute_dtype),
                model_state,
                args,
                kwargs,
                train=train,
                rng=rng,
            )
        return cast_floats(outputs, jnp.float32), model_state, reports

    def adapting(self, train: bool):
        """The context in which the model's targeted modules add their LoRA adapters (none
        without `lora`)."""
        return self.lora.adapting(train) if self.lora else contextlib.nullcontext()

    def binding_axes(self):
        """The context in which the model's layers reduce over the strategy's axes for the axis
        names they were given (`axis_aliases`): the pipeline engine applies its layers itself."""
        bind = getattr(self._module, "binding_axes", None)
        return bind() if bind else contextlib.nullcontext()

    def frozen(self, params):
        """`params` as the model sees them: with LoRA, the base without gradient."""
        return self.lora.freeze(params) if self.lora else params

    # --------------------------------------------------------- what trains, what is frozen
    def trainable(self, tree):
        """The part of a tree shaped like the parameters (or like a part of them: gradients,
        partition specs, one layer's) that trains: with LoRA the adapters, else all of it.
        Gradients, their reductions, the optimizer and its state cover this part alone."""
        return lora.split(tree)[1] if self.lora else tree

    def with_trainable(self, params, trainable):
        """`params` with their trainable part replaced by `trainable`."""
        return lora.joined(lora.split(params)[0], trainable) if self.lora else trainable

    def model_inputs(self, batch: Batch) -> dict:
        """The entries of `batch` the model takes."""
        return {entry: batch[entry] for entry in self.inputs.entries}

    def weighted_values(self, outputs, batch: Batch) -> dict[str, tuple[jax.Array, Any]]:
        """`loss` and every metric per example as (weighted values, weights or None), see
        jddp/core/weighted.py."""
        fns = {"loss": self.loss_fn, **self.metrics}
        return weighted_values(fns, outputs, batch, self.batch_rows(batch), self.weight_key)

    def totals(self, outputs, batch: Batch) -> Totals:
        """The `Totals` of `batch`'s loss and metrics (the pipeline engine's per micro-batch)."""
        return Totals.of(self.weighted_values(outputs, batch))

    # ------------------------------------------------------------------------- gradients
    def _slice_totals(self, params, model_state, batch: Batch, rng):
        """`Totals` of one slice's batch (with the metrics the model sowed), the updated mutable
        collections, and the sum of the losses the model sowed (None: none)."""
        outputs, model_state, reports = self._forward_sown(
            params, model_state, batch, train=True, rng=rng
        )
        totals = self.totals(outputs, batch)
        reported = sown.sown_metrics(reports)
        if reported:
            totals = totals.replace(sums={**reported, **totals.sums})
        return totals, model_state, sown.sown_loss(reports)

    def _micro_grads(self, params, model_state, batch, rng, params_fn, scale, slices=None):
        totals_fn = slices.bind(self._slice_totals) if slices else self._slice_totals

        def scaled_loss(trainable):  # the frozen parameters enter as constants
            params_used = params_fn(self.with_trainable(params, trainable))
            totals, new_model_state, extra = totals_fn(params_used, model_state, batch, rng)
            loss = totals.sums["loss"]
            if extra is not None:
                if "loss" in totals.weights:
                    # The step divides the gradient by the global mean loss weight, which a
                    # device does not know before its backward pass.
                    raise ConfigError(
                        "a model's sown losses (a mixture of experts' auxiliary losses) are "
                        "not added to a weighted loss yet (a loss mask or weight_key); set "
                        "their weights to 0, or train with an unweighted loss"
                    )
                loss = loss + extra
            return (loss if scale is None else loss * scale), (totals, new_model_state)

        (_, (totals, model_state)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(
            self.trainable(params)
        )
        return grads, totals, model_state

    def local_grads(
        self,
        params,
        model_state,
        batch: Batch,
        rng: jax.Array,
        params_fn=None,
        loss_scale=None,
        slices: Slices | None = None,
    ):
        """(gradient, `Totals`, mutable collections) of `batch`, over `grad_accum_steps`
        micro-batches: the gradient of the mean (weighted) loss with respect to the trainable
        parameters (`trainable`; with LoRA the adapters alone), before `apply_gradients`
        divides it by the mean weight and the loss scale.

        No collective of its own: a strategy averages the result across devices once per step.
        `params_fn` maps the state's parameters to the ones the model uses (ZeRO-3 gathers its
        shards there); gradients are taken with respect to `params`. `loss_scale` is the state's
        (float16: the loss is multiplied by its scale). With `slices` (jddp/core/slices.py),
        `batch` is a whole global batch that many devices would split, `rng` the step's key,
        and the result theirs.
        """
        params_fn = params_fn or (lambda params: params)
        scale = loss_scale["scale"] if self.loss_scaling else None
        steps = self.grad_accum_steps
        size = self.batch_rows(batch)
        step_key, rng = rng, row_keys.as_row_key(rng, size)
        if steps == 1:
            return self._micro_grads(params, model_state, batch, rng, params_fn, scale, slices)
        count = slices.count if slices else 1  # the devices' slices `batch` holds
        if size % (count * steps):
            raise ShapeError(
                f"a device's batch of {size // count} examples does not split into "
                f"{steps} micro-batches; make global_batch_size divisible by devices x "
                "grad_accum_steps"
            )
        if slices:
            micro_batches = slices.micro_batches(batch, steps, size)
        else:
            micro_batches = jax.tree.map(
                lambda x: x.reshape(steps, size // steps, *x.shape[1:]), batch
            )

        def accumulate(carry, inputs):
            grad_sum, totals_sum, model_state = carry
            index, micro_batch = inputs
            if slices:
                micro_rng = slices.micro_key(step_key, index, steps, size)
            else:
                micro_rng = row_keys.sub_batch_key(rng, index * (size // steps), size // steps)
            grads, totals, model_state = self._micro_grads(
                params, model_state, micro_batch, micro_rng, params_fn, scale, slices
            )
            add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
            return (add(grad_sum, grads), add(totals_sum, totals), model_state), None

        zeros = jax.tree.map(jnp.zeros_like, self.trainable(params))
        first = jax.tree.map(lambda x: x[0], micro_batches)
        shapes = jax.eval_shape(
            lambda: self._micro_grads(params, model_state, first, rng, params_fn, scale, slices)[1]
        )
        totals_zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (grad_sum, totals_sum, model_state), _ = jax.lax.scan(
            accumulate,
            (zeros, totals_zeros, model_state),
            (jnp.arange(steps), micro_batches),
        )
        mean = lambda tree: jax.tree.map(lambda x: x / steps, tree)  # noqa: E731
        return mean(grad_sum), mean(totals_sum), model_state

    # ---------------------------------------------------------------------------- update
    def apply_gradients(
        self, state: TrainState, grads, model_state, totals: Totals, comm_state=None
    ):
        """The optimizer update with gradients and `Totals` already averaged over devices (and
        the strategy's next `comm_state`, kept or dropped with the update; None: unchanged).

        Divides the gradient by the mean loss weight and the loss scale, adds the regularizer's.
        Counts a step whose loss (or gradient norm, when computed) is not finite in
        `nonfinite_steps`; with `skip_nonfinite` such a step leaves parameters, optimizer state and
        mutable collections as they were, on every device alike (the decision is made on the
        averaged values). With loss scaling a step whose gradients are not finite is always
        skipped and the scale lowered; it counts as non-finite only when its loss is, or the scale
        is at its minimum. Adds `grad_norm` to metrics when `log_grad_norm`: one more pass over the
        gradients, shared with clipping when the optimizer clips.
        """
        metrics = totals.means()
        grads = self._unscaled(grads, totals, state.loss_scale)
        trainable = self.trainable(state.params)
        if self.regularizer is not None:
            penalty, penalty_grads = jax.value_and_grad(
                lambda trainable: self.regularizer(self.with_trainable(state.params, trainable))
            )(trainable)
            grads = jax.tree.map(jnp.add, grads, penalty_grads)
            metrics["regularizer"] = penalty
        updates, opt_state = self.optimizer.update(grads, state.opt_state, trainable)
        comm_state = state.comm_state if comm_state is None else comm_state
        updated = (optax.apply_updates(trainable, updates), opt_state, model_state, comm_state)
        finite = finite_loss = jnp.isfinite(metrics["loss"])
        if self.log_grad_norm or self.skip_nonfinite or self.loss_scaling:
            grad_norm = optax.global_norm(grads)
            finite &= jnp.isfinite(grad_norm)
            if self.log_grad_norm:
                metrics["grad_norm"] = grad_norm
        counted, loss_scale = ~finite, state.loss_scale
        if self.loss_scaling:
            metrics["loss_scale"] = loss_scale["scale"]  # the scale this step used
            counted = ~finite_loss | (~finite & self.loss_scaling.at_minimum(loss_scale))
            loss_scale = self.loss_scaling.update(loss_scale, finite)
        if self.skip_nonfinite or self.loss_scaling:
            kept = (trainable, state.opt_state, state.model_state, state.comm_state)
            updated = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, kept)
        trainable, opt_state, model_state, comm_state = updated
        new_state = state.replace(
            step=state.step + 1,
            params=self.with_trainable(state.params, trainable),
            opt_state=opt_state,
            model_state=model_state,
            nonfinite_steps=state.nonfinite_steps + counted.astype(jnp.int32),
            loss_scale=loss_scale,
            comm_state=comm_state,
        )
        return new_state, metrics

    def _unscaled(self, grads, totals: Totals, loss_scale):
        """The gradient of the mean loss: the averaged gradient over the mean loss weight and
        the loss scale (untouched when there are neither)."""
        divisor = totals.weights.get("loss")
        if self.loss_scaling:
            scale = loss_scale["scale"]
            divisor = scale if divisor is None else divisor * scale
        if divisor is None:
            return grads
        return jax.tree.map(lambda g: g / divisor, grads)

    # ------------------------------------------------------------------------------ eval
    def eval_sums(self, params, model_state, batch: Batch) -> dict:
        """Over the examples whose `mask` is 1: `sums` of loss and each metric (weighted),
        their `weights` (1 per example where unweighted), and the `count` of examples."""
        outputs, _ = self.forward(params, model_state, batch, train=False)
        return masked_sums(self.weighted_values(outputs, batch), batch["mask"])


def check_divisible(
    global_batch_size: int, num_devices: int, grad_accum_steps: int, what: str = "devices"
) -> int:
    """The per-device micro-batch size, or a ConfigError naming the sizes that do not divide
    (`what` names `num_devices`: the parts each batch is split into)."""
    parts = num_devices * grad_accum_steps
    if global_batch_size < 1 or global_batch_size % parts:
        below = global_batch_size // parts * parts
        nearest = " or ".join(str(n) for n in (below, below + parts) if n > 0)
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not divisible by {what} x grad_accum_steps "
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


def init_key(seed) -> jax.Array:
    """The PRNG key an initialization draws from: `seed` as a non-negative int, or a JAX key
    itself (`jax.random.key(0)`, or a legacy `jax.random.PRNGKey(0)`)."""
    if isinstance(seed, jax.Array | np.ndarray):
        if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) and seed.shape == ():
            return seed
        if seed.dtype == np.uint32 and seed.shape == (2,):  # jax.random.PRNGKey's raw form
            return jax.random.wrap_key_data(seed)
    if isinstance(seed, int | np.integer) and not isinstance(seed, bool) and seed >= 0:
        return jax.random.key(int(seed))
    given = (
        f"an array of shape {seed.shape} and dtype {seed.dtype}"
        if isinstance(seed, jax.Array | np.ndarray)
        else repr(seed)
    )
    raise UsageError(
        f"seed must be a non-negative integer or a JAX key (jax.random.key(0)), got {given}"
    )
