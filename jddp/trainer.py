"""`Trainer`: the library entry point. Your Flax module, loss and optax optimizer, data-parallel."""

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np
import optax
from flax import linen as nn

from jddp import hlo
from jddp.core import PerExampleFn, Task, check_divisible, compute_dtype_of
from jddp.data.padding import pad_batch
from jddp.errors import ShapeError
from jddp.memory import peak_bytes, state_bytes_per_device
from jddp.state import TrainState
from jddp.strategies import make_strategy
from jddp.strategies.compression import GradComm

# Programs dispatched ahead of the host before it waits. Unbounded dispatch of collective
# programs deadlocked XLA:CPU (8 simulated devices, one process, after ~300 steps) and gloo
# across processes (shared NOTES); a small bound costs nothing, since the host runs ahead anyway.
MAX_STEPS_IN_FLIGHT = 4


class InFlightBound:
    """Waits for the oldest dispatched program once more than `limit` are outstanding."""

    def __init__(self, limit: int):
        self.limit = limit
        self._outputs = collections.deque()

    def add(self, output: jax.Array) -> None:
        self._outputs.append(output)
        if len(self._outputs) > self.limit:
            self._outputs.popleft().block_until_ready()


class Trainer:
    """Trains `model` on global batches under a data-parallel strategy.

    `loss_fn(outputs, batch)` and each of `metrics` return one value per example. Batches are
    dicts of arrays whose first axis is the *global* batch (this process's rows of it when
    several processes train together); the trainer splits them across devices and
    `grad_accum_steps` micro-batches, so results do not depend on the device count.

    `strategy`: `ddp` (pmap over the local devices) or `zero1`, `zero2`, `zero3` (= `fsdp`),
    `hybrid` (a `jax.sharding.Mesh` over all devices: `mesh` like `"replica:2,shard:-1"`,
    partition `rules` as `(regex, spec)` pairs, tensors under `min_shard_size` elements
    replicated); see `jddp/strategies/zero.py` and `jddp/sharding/rules.py`.
    `grad_comm_dtype` ("float32" or "bfloat16") and `grad_compression` ("none" or "powersgd",
    ddp only, with `powersgd_rank` and `powersgd_start_step`): how gradients cross devices, see
    `jddp/strategies/compression.py`.
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
        mesh: str | None = None,
        rules: Sequence[tuple[str, str]] = (),
        min_shard_size: int | None = None,
        grad_accum_steps: int = 1,
        compute_dtype: str = "float32",
        input_key: str = "image",
        log_grad_norm: bool = True,
        skip_nonfinite: bool = False,
        grad_comm_dtype: str = "float32",
        grad_compression: str = "none",
        powersgd_rank: int = 4,
        powersgd_start_step: int = 0,
    ):
        grad_comm = GradComm(grad_comm_dtype, grad_compression, powersgd_rank, powersgd_start_step)
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
            init_comm_state=grad_comm.init_state if grad_comm.powersgd else None,
        )
        self.strategy = make_strategy(
            strategy,
            self.task,
            devices,
            mesh=mesh,
            rules=rules,
            min_shard_size=min_shard_size,
            grad_comm=grad_comm,
        )
        self._in_flight = InFlightBound(MAX_STEPS_IN_FLIGHT)

    @property
    def num_devices(self) -> int:
        return self.strategy.num_devices

    def init(self, seed: int, sample_batch: Mapping[str, np.ndarray]) -> TrainState:
        """The initial state from `seed`, placed on the devices (one example shapes the model)."""
        sample_input = np.asarray(self._model_input(sample_batch))[:1]
        return self.strategy.init_state(seed, sample_input)

    def _model_input(self, batch):
        if self.task.input_key not in batch:
            raise ShapeError(
                f"batch has no {self.task.input_key!r} entry (keys: {sorted(batch)}); "
                "pass input_key= to name the model input"
            )
        return batch[self.task.input_key]

    def abstract_state(self, sample_batch) -> TrainState:
        """The state's shapes, dtypes and shardings, without computing it: a restore target."""
        sample_input = np.asarray(self._model_input(sample_batch))[:1]
        state = jax.eval_shape(self.task.init_state, jax.random.key(0), sample_input)
        return jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            state,
            self.strategy.state_shardings(state),
        )

    def replace_params(self, state: TrainState, params) -> TrainState:
        """`state` with `params` (host arrays shaped like its own) placed as its own are."""
        placed = jax.tree.map(
            lambda x, host: jax.make_array_from_callback(x.shape, x.sharding, lambda i: host[i]),
            state.params,
            params,
        )
        return state.replace(params=placed)

    def check_layout(self, sample_batch) -> None:
        """Raises ConfigError now, before any work, if the partition rules do not fit the model
        (computed from shapes alone: nothing is initialized)."""
        self.abstract_state(sample_batch)

    def place_batch(self, batch: Mapping[str, np.ndarray]) -> "PlacedBatch":
        """A global batch moved to the devices (`step` does it itself; prefetchers do it early)."""
        global_rows = len(self._model_input(batch)) * jax.process_count()  # equal rows each
        check_divisible(global_rows, self.num_devices, self.task.grad_accum_steps)
        return PlacedBatch(self.strategy.place_batch(batch))

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on a global batch (host arrays, or already placed by `place_batch`).

        Returns the new state and device-side scalar metrics (`loss`, each metric, and
        `grad_norm`, the global norm of the averaged gradient before clipping, if logged);
        reading them waits for the step, so read them only when you log.
        """
        if not isinstance(batch, PlacedBatch):
            batch = self.place_batch(batch)
        state, metrics = self.strategy.train_step(state, batch.arrays)
        self._in_flight.add(metrics["loss"])
        return state, metrics

    def evaluate(self, state: TrainState, batches: Iterable[Mapping[str, np.ndarray]]):
        """Mean loss and metrics over every example of `batches`, each counted exactly once.

        Batches may be ragged; each is padded (and masked) to the size of the first, rounded up to
        a multiple of the device count, so one compiled program serves the whole pass.
        """
        sums, padded_size = [], None
        for batch in batches:
            if padded_size is None:
                size = len(self._model_input(batch))
                padded_size = -(-size // self.num_devices) * self.num_devices
            placed = self.strategy.place_batch(pad_batch(batch, padded_size))
            sums.append(self.strategy.eval_step(state, placed))
            self._in_flight.add(sums[-1]["count"])
        if not sums:
            raise ValueError("evaluate() got no batches")
        totals = jax.tree.map(
            lambda *xs: float(np.sum(xs, dtype=np.float64)), *jax.device_get(sums)
        )
        count = totals.pop("count")
        return {name: value / count for name, value in totals.items()} | {"count": count}

    def memory_report(self, state: TrainState, batch) -> dict[str, int]:
        """Bytes per device: the state's shards, the compiled step's peak (XLA's analysis), and
        what its collectives move per step (`jddp.hlo.ring_bytes`; with a PowerSGD warm-up, the
        compressed steps')."""
        if not isinstance(batch, PlacedBatch):
            batch = self.place_batch(batch)
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


@dataclasses.dataclass(frozen=True)
class PlacedBatch:
    """A global batch already on the devices, laid out as the strategy wants it."""

    arrays: Mapping[str, jax.Array]
