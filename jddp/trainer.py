"""`Trainer`: the library entry point. Your Flax module, loss and optax optimizer, data-parallel."""

import collections
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np
import optax
from flax import linen as nn

from jddp.core.lora import LoRA
from jddp.core.loss_scale import DynamicLossScale
from jddp.core.state import TrainState, arranged_like
from jddp.core.task import PerExampleFn, Task, check_divisible, compute_dtype_of, init_key
from jddp.core.tree_paths import path_str
from jddp.data.padding import pad_batch
from jddp.errors import ConfigError, ShapeError, UsageError
from jddp.observe import hlo
from jddp.observe.memory import peak_bytes, state_bytes_per_device
from jddp.parallel.grad_reduction import GradComm
from jddp.parallel.mesh import DDP_AXIS, DeviceMesh
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.rules import DEFAULT_MIN_SHARD_SIZE
from jddp.parallel.strategies import device_mesh_for, make_strategy
from jddp.runtime.processes import join_launched_job

# Programs dispatched ahead of the host before it waits, on XLA:CPU (`parallel.collectives=cpu`):
# unbounded dispatch of programs with collectives can deadlock XLA:CPU, both across simulated
# devices in one process and across processes over gloo (tens of steps in flight are enough); a
# small bound costs nothing, since the host stays ahead of the devices anyway.
MAX_STEPS_IN_FLIGHT = 4


def steps_in_flight_bound(collectives: str) -> int | None:
    """The trainer's bound on steps in flight for a resolved `collectives` choice: 4 on XLA:CPU;
    none with `native` collectives, where the runtime bounds its own queue (PjRt's GPU client
    lets 32 executions run ahead of a device, then blocks the caller) and nothing deadlocks."""
    return MAX_STEPS_IN_FLIGHT if collectives == "cpu" else None


class InFlightBound:
    """Waits for the oldest dispatched program once more than `limit` are outstanding (None:
    never waits, keeps nothing)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._outputs = collections.deque()

    def add(self, output: jax.Array) -> None:
        if self.limit is None:
            return
        self._outputs.append(output)
        if len(self._outputs) > self.limit:
            self._outputs.popleft().block_until_ready()


class Trainer:
    """Trains `model` on global batches under a data-parallel strategy.

    `loss_fn(outputs, batch)` and each of `metrics` return one value per example, or a pair
    (weighted sums, weights) per example; `weight_key` names a batch entry of per-example weights
    for those that return plain values. Each is then the weighted mean over the whole global
    batch, sum(w * l) / sum(w). `regularizer(params)` is added to the training loss (an L2
    penalty). Batches are dicts of arrays whose first axis is the *global* batch (this process's
    rows of it when several processes train together); the trainer splits them across devices
    and `grad_accum_steps` micro-batches, so results do not depend on the device count.
    `input_key` names the model's input entry, or a tuple of entries (positional inputs) or a
    dict of call argument -> entry (keyword inputs). `compute_dtype="float16"` scales the loss
    dynamically (`loss_scaling`, see jddp/core/loss_scale.py).

    `strategy`: `ddp` (pmap over every device) or `zero1`, `zero2`, `zero3` (= `fsdp`),
    `hybrid`, `auto` (a `jax.sharding.Mesh` over every device: `mesh` like
    `"data:2,fsdp:2,tensor:2"` or a `DeviceMesh` already built, partition `rules` as `(regex,
    spec)` pairs, tensors under `min_shard_size` elements replicated); see
    `jddp/parallel/zero.py`, `jddp/parallel/auto.py` (zero3's layout, the collectives XLA's
    partitioner picks) and `jddp/parallel/rules.py`. `device_mesh` is the mesh it runs on under
    every strategy (ddp's: one `batch` axis over the devices). A mesh with a `stage` axis
    pipelines the model's `jddp.parallel.pipeline.Pipelined` stack as `pipeline`
    (`PipelineOptions`) says. A layer reducing over the axis `"batch"` (a pmap-era
    `nn.BatchNorm(axis_name="batch")`) reduces over the whole global batch under every strategy.
    `grad_comm_dtype` ("float32" or "bfloat16") and `grad_compression` ("none" or "powersgd",
    ddp only, with `powersgd_rank` and `powersgd_start_step`): how gradients cross devices, see
    `jddp/parallel/grad_reduction.py`. `collectives` ("auto", "cpu" or "native"): XLA's own
    collectives ("native", auto's choice on GPU and TPU) or XLA:CPU's and gloo's workarounds
    ("cpu", auto's choice on CPU), see `jddp/parallel/collectives.py`.
    `lora` (`jddp.LoRA(rank, alpha, dropout, targets)`): train low-rank adapters on the targeted
    projections and freeze every other parameter (jddp/core/lora.py).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: PerExampleFn,
        optimizer: optax.GradientTransformation,
        *,
        metrics: Mapping[str, PerExampleFn] | None = None,
        strategy: str = "ddp",
        devices: Sequence[jax.Device] | None = None,
        mesh: str | DeviceMesh | None = None,
        rules: Sequence[tuple[str, str]] = (),
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        pipeline: PipelineOptions | None = None,
        grad_accum_steps: int = 1,
        compute_dtype: str = "float32",
        input_key: str | Sequence[str] | Mapping[str, str] = "image",
        log_grad_norm: bool = True,
        skip_nonfinite: bool = False,
        regularizer=None,
        weight_key: str | None = None,
        loss_scaling: DynamicLossScale | None = None,
        grad_comm_dtype: str = GradComm.dtype,
        grad_compression: str = GradComm.compression,
        powersgd_rank: int = GradComm.powersgd_rank,
        powersgd_start_step: int = GradComm.powersgd_start_step,
        collectives: str = GradComm.collectives,
        lora: LoRA | None = None,
    ):
        # A script started as one of a job (jddp-launch, SLURM, mpirun, Kubernetes, a TPU pod)
        # joins it here, before anything looks at the devices.
        join_launched_job()
        grad_comm = GradComm(
            grad_comm_dtype, grad_compression, powersgd_rank, powersgd_start_step, collectives
        )
        # The mesh first: the model's axis names are the strategy's.
        self.device_mesh = (
            mesh if isinstance(mesh, DeviceMesh) else device_mesh_for(strategy, mesh, devices)
        )
        # Which platform's collectives, decided once for the mesh's devices.
        grad_comm = grad_comm.on(list(self.device_mesh.mesh.devices.flat))
        self.collectives = grad_comm.collectives
        # A layer reducing over "batch" (the Flax convention) reduces over the mesh's batch
        # axes; ddp's one axis has that name already.
        batch_axes = self.device_mesh.batch_axes
        aliases = {} if batch_axes == (DDP_AXIS,) else {"batch": batch_axes}
        self.task = Task(
            model=model,
            loss_fn=loss_fn,
            optimizer=optimizer,
            metrics=dict(metrics or {}),
            input_key=input_key,
            compute_dtype=compute_dtype_of(compute_dtype),
            grad_accum_steps=grad_accum_steps,
            log_grad_norm=log_grad_norm,
            skip_nonfinite=skip_nonfinite,
            regularizer=regularizer,
            weight_key=weight_key,
            loss_scaling=loss_scaling,
            axis_aliases=aliases,
            init_comm_state=grad_comm.init_state if grad_comm.powersgd else None,
            lora=lora,
        )
        if self.device_mesh.stage_axis and self.task.loss_scaling:
            raise ConfigError(
                "pipeline parallelism (a stage axis) does not take float16 loss scaling yet; "
                "use bfloat16, or no stage axis"
            )
        self._pipeline = pipeline or PipelineOptions()
        self.strategy = make_strategy(
            strategy,
            self.task,
            self.device_mesh,
            rules=rules,
            min_shard_size=min_shard_size,
            pipeline=pipeline,
            grad_comm=grad_comm,
        )
        self._in_flight = InFlightBound(steps_in_flight_bound(self.collectives))
        self._abstract_for = None  # (input shape, dtype) the strategy was prepared for
        self._rows_checked = None  # the rows per batch `place_batch` found divisible

    @property
    def num_devices(self) -> int:
        return self.strategy.num_devices

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline step (1 without a stage axis), from `pipeline`'s options
        and the mesh alone."""
        return self._pipeline.microbatches_per_step(self.device_mesh)

    @property
    def batch_slices(self) -> int:
        """Into how many slices each global batch is split (devices along `tensor` share one)."""
        return self.device_mesh.batch_slices

    @property
    def row_block(self) -> tuple[int, int]:
        """(block, blocks): the rows of every global batch this process passes to `step`,
        `place_batch` and `evaluate` are block `block` of `blocks` equal consecutive blocks.
        Usually (process index, process count); processes that differ only along tensor or
        stage (pipeline stages on different hosts) hold the same batch slices, so they pass the
        same block: a stage:2 mesh over 2 processes has blocks = 1, and both read every row."""
        return self.strategy.row_block()

    def process_rows(self, global_batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This process's rows of `global_batch` (its `row_block`; the whole batch for one
        process): what `step`, `place_batch`, `evaluate` and `jddp.fit` take, so that a script
        that builds every global batch itself runs unchanged, and equal, on any process count."""
        block, blocks = self.row_block
        rows = self._check_entries(global_batch)
        if rows % blocks:
            raise ShapeError(
                f"the global batch has {rows} rows, which do not split into {blocks} equal blocks "
                "(one per process); make the global batch size a multiple of the process count"
            )
        part = rows // blocks
        return jax.tree.map(
            lambda x: np.asarray(x)[block * part : (block + 1) * part], global_batch
        )

    def init(self, seed: int | jax.Array, sample_batch: Mapping[str, np.ndarray]) -> TrainState:
        """The initial state from `seed` (an int or a JAX key), placed on the devices (one
        example shapes the model)."""
        init_key(seed)  # a bad seed is one line here, before anything compiles
        self.abstract_state(sample_batch)
        with _axis_names_checked:
            return self.strategy.init_state(seed, self._sample_input(sample_batch))

    def _sample_input(self, sample_batch) -> dict[str, np.ndarray]:
        """The model's inputs for one example of `sample_batch`."""
        self._check_entries(sample_batch)
        return {k: np.asarray(v)[:1] for k, v in self.task.model_inputs(sample_batch).items()}

    def _check_entries(self, batch) -> int:
        """The number of rows of `batch`; a ShapeError names an entry the model needs that is
        missing, or one whose leading size differs (host-side shapes only)."""
        weight_key = self.task.weight_key
        needed = self.task.inputs.entries + ((weight_key,) if weight_key else ())
        for entry in needed:
            if entry not in batch:
                option = "weight_key" if entry == weight_key else "input_key"
                raise ShapeError(
                    f"batch has no {entry!r} entry (keys: {sorted(batch)}); pass {option}= to "
                    "name the entry it is in"
                )
        first = needed[0]
        rows = _leading_size(batch[first])
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            size = _leading_size(leaf)
            if size != rows:
                raise ShapeError(
                    f"batch entry {path_str(path)!r} has leading size {size} but {first!r} has "
                    f"{rows}; every entry needs one row per example"
                )
        return rows

    def abstract_state(self, sample_batch) -> TrainState:
        """The state's shapes, dtypes and shardings, without computing it: a restore target.

        Computed once per model input shape; the strategy lays the state out and builds its
        step programs then."""
        sample_input = self._sample_input(sample_batch)
        key = tuple((k, x.shape, x.dtype) for k, x in sample_input.items())
        if self._abstract_for != key:
            with _axis_names_checked:
                shapes, stack = self.task.abstract_state(sample_input)
            self.strategy.prepare(shapes, stack)
            self._abstract = jax.tree.map(
                lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                shapes,
                self.strategy.state_shardings(),
            )
            self._abstract_for = key
        return self._abstract

    def replace_state(
        self, state: TrainState, *, params=None, model_state=None, opt_state=None
    ) -> TrainState:
        """`state` with any of `params`, `model_state` (`{"batch_stats": ...}`) and `opt_state`
        replaced by host arrays of the same paths and shapes, placed as `state`'s own: how a run
        starts from weights it already has. A ShapeError names the first path that differs."""
        given = {"params": params, "model_state": model_state, "opt_state": opt_state}
        if state.layer_order is not None:  # host arrays come in the model's layer order
            state = self.global_state(state)
        placed = {}
        for name, host in given.items():
            if host is None:
                continue
            ours = getattr(state, name)
            placed[name] = jax.tree.map(
                lambda x, h: jax.make_array_from_callback(x.shape, x.sharding, lambda i: h[i]),
                ours,
                arranged_like(ours, host, name),
            )
        return state.replace(**placed)

    def check_layout(self, sample_batch, global_batch_size: int | None = None) -> None:
        """Raises ConfigError now, before any work, if the partition rules or the pipeline do
        not fit the model, or `global_batch_size` does not split into batch slices x
        micro-batches x accumulation steps (computed from shapes alone: nothing is
        initialized)."""
        self.abstract_state(sample_batch)
        if global_batch_size is not None:
            parts, accum = self.batch_slices * self.microbatches, self.task.grad_accum_steps
            if self.microbatches > 1:
                check_divisible(global_batch_size, parts, accum, "batch slices x micro-batches")

    def place_batch(self, batch: Mapping[str, np.ndarray]) -> "PlacedBatch":
        """A global batch moved to the devices (`step` does it itself; prefetchers do it early)."""
        rows = self._check_entries(batch)
        if rows != self._rows_checked:  # the same every step: checked once
            check_divisible(
                rows * self.row_block[1],
                self.batch_slices * self.microbatches,
                self.task.grad_accum_steps,
            )
            self._rows_checked = rows
        return PlacedBatch(self.strategy.place_batch(batch))

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on a global batch (host arrays, or already placed by `place_batch`).

        Returns the new state and device-side scalar metrics (`loss`, each metric, `grad_norm`,
        the global norm of the averaged gradient before clipping, if logged, `regularizer` with a
        regularizer, `loss_scale` under float16); reading them waits for the step, so read them
        only when you log.
        """
        _check_state(state, "step")
        if not isinstance(batch, PlacedBatch):
            batch = self.place_batch(batch)
        with _axis_names_checked:
            state, metrics = self.strategy.train_step(state, batch.arrays)
        self._in_flight.add(metrics["loss"])
        return state, metrics

    def evaluate(self, state: TrainState, batches: Iterable[Mapping[str, np.ndarray]]):
        """Mean loss and metrics over every example of `batches`, each counted exactly once.

        Batches may be ragged; each is padded (and masked) to the size of the first, rounded up to
        a multiple of the device count, so one compiled program serves the whole pass.
        """
        _check_state(state, "evaluate")
        sums, padded_size = [], None
        for batch in batches:
            size = self._check_entries(batch)
            if "mask" in batch and np.shape(batch["mask"]) != (size,):
                raise ShapeError(
                    f"batch entry 'mask' has shape {np.shape(batch['mask'])}, but in evaluation "
                    f"it is jddp's padding mask, one value per example ({size},); give an "
                    "attention mask another name, such as 'attention_mask'"
                )
            if padded_size is None:
                padded_size = -(-size // self.batch_slices) * self.batch_slices
            placed = self.strategy.place_batch(pad_batch(batch, padded_size))
            with _axis_names_checked:
                sums.append(self.strategy.eval_step(state, placed))
            self._in_flight.add(sums[-1]["count"])
        if not sums:
            raise ValueError("evaluate() got no batches")
        totals = jax.tree.map(
            lambda *xs: float(np.sum(xs, dtype=np.float64)), *jax.device_get(sums)
        )
        weights = totals["weights"]
        means = {name: total / weights[name] for name, total in totals["sums"].items()}
        return means | {"count": totals["count"]}

    def memory_report(self, state: TrainState, batch) -> dict[str, int]:
        """Bytes per device: the state's shards, the compiled step's peak (XLA's analysis), and
        what its collectives move per step (`jddp.observe.hlo.ring_bytes`; with a PowerSGD
        warm-up, the compressed steps')."""
        if not isinstance(batch, PlacedBatch):
            batch = self.place_batch(batch)
        with _axis_names_checked:
            compiled = self.strategy.lower_train_step(state, batch.arrays).compile()
        return {
            "state_bytes_per_device": state_bytes_per_device(state),
            "peak_bytes_per_device": peak_bytes(compiled),
            "comm_bytes_per_step": hlo.step_ring_bytes(compiled.as_text()),
        }

    def consolidate(self, state: TrainState) -> TrainState:
        """`state` with what differs between devices made the same (PowerSGD's per-device
        errors become their mean, the only part of them later steps depend on): what a
        checkpoint holds. Continue from it, and a run resumed from that checkpoint repeats this
        one bit for bit."""
        return self.strategy.consolidate(state)

    def global_state(self, state: TrainState) -> TrainState:
        """`state` as global arrays spanning every process: what orbax saves."""
        return self.strategy.global_state(state)

    def host_state(self, state: TrainState) -> TrainState:
        """The state as ordinary numpy arrays on the host, whatever the strategy."""
        return self.strategy.host_state(state)


def _leading_size(x) -> int | None:
    shape = np.shape(x)
    return shape[0] if shape else None


def _check_state(state, what: str) -> None:
    """A UsageError unless `state` is a TrainState (a `step` before `init` passes None)."""
    if not isinstance(state, TrainState):
        raise UsageError(
            f"Trainer.{what} got {type(state).__name__}, not a TrainState; call state = "
            f"trainer.init(seed, sample_batch) first and pass the state it returns"
        )


class _AxisNamesChecked:
    """A model reducing over an axis no strategy has is a one-line ConfigError, not JAX's
    NameError from deep inside the trace. (A class, not a generator: it wraps every step.)"""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is None or not issubclass(kind, NameError):
            return False
        match = re.search(r"unbound axis name: (\w+)", str(error))
        if not match:
            return False
        raise ConfigError(
            f"the model reduces over an axis named {match.group(1)!r}, which this strategy does "
            "not have; name the batch axis 'batch' (e.g. nn.BatchNorm(axis_name='batch')): "
            "jddp binds it to the strategy's batch axes"
        ) from None


_axis_names_checked = _AxisNamesChecked()


@dataclasses.dataclass(frozen=True)
class PlacedBatch:
    """A global batch already on the devices, laid out as the strategy wants it."""

    arrays: Mapping[str, jax.Array]
