"""DDP on `jax.pmap`: a full replica of the state per device, gradients averaged with `lax.pmean`.

The state is one array per leaf, replicated on every device (`NamedSharding(mesh, P())`), and
crosses the pmap boundary with `in_axes=None` / `out_axes=None`; batches carry a leading axis of
one slice per device. Stacking replicas along a leading axis instead (the textbook pmap layout)
makes XLA copy the optimizer state in and out of every step: 18 copies for Adam on an MLP, and
a third fewer examples/s at 8 devices (experiments/bench/ddp_overhead.py).
"""

from collections.abc import Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.core import Task, check_rows_divide, jit_init
from jddp.state import TrainState
from jddp.strategies.collectives import fused_pmean

AXIS = "batch"


class DDP:
    """Replicated state, one slice of every global batch per device, identical updates."""

    name = "ddp"
    batch_axis_name = AXIS  # SyncBatchNorm: nn.BatchNorm(axis_name=...) averages over replicas

    def __init__(self, task: Task, devices: Sequence[jax.Device] | None = None):
        self.task = task
        # Every device of every process; each process feeds and reads its local ones.
        self.devices = list(devices) if devices is not None else jax.devices()
        self._local_count = sum(d.process_index == jax.process_index() for d in self.devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))  # placement only; pmap maps over it
        self._replicated = NamedSharding(self.mesh, P())
        self._per_device = NamedSharding(self.mesh, P(AXIS))
        self._train_step = jax.pmap(
            self._train,
            AXIS,
            devices=self.devices,
            in_axes=(None, 0),
            out_axes=None,
            donate_argnums=0,
        )
        self._eval_step = jax.pmap(
            self._eval, AXIS, devices=self.devices, in_axes=(None, 0), out_axes=None
        )

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    # ------------------------------------------------------------ per-device programs
    def _train(self, state: TrainState, batch):
        # Each replica draws its own dropout masks: its examples differ from its neighbours'.
        rng = jax.random.fold_in(state.step_key(), lax.axis_index(AXIS))
        grads, metrics, model_state = self.task.local_grads(
            state.params, state.model_state, batch, rng, loss_scale=state.loss_scale
        )
        grads, metrics, model_state = fused_pmean((grads, metrics, model_state), AXIS)
        return self.task.apply_gradients(state, grads, model_state, metrics)

    def _eval(self, state: TrainState, batch):
        return lax.psum(self.task.eval_sums(state.params, state.model_state, batch), AXIS)

    # ----------------------------------------------------------------------- placement
    def prepare(self, abstract_state: TrainState) -> None:
        """Everything is replicated: the programs do not depend on the state's shapes."""
        self._abstract_state = abstract_state

    def init_state(self, seed: int, sample_input) -> TrainState:
        """Initialize once from `seed`, then place the same state on every device."""
        state = jit_init(self.task.init_state, jax.random.key(seed), sample_input)
        return self.place_state(state)

    def lower_init(self, seed: int, sample_input):
        return jax.jit(self.task.init_state).lower(jax.random.key(seed), sample_input)

    def place_state(self, state: TrainState) -> TrainState:
        """One full copy of `state` on every device.

        From host arrays: across processes JAX then also checks that every process passes the
        same values, and device_put of a device array to this sharding built a broken array
        with one local device per process (jax 0.10.2)."""
        return jax.device_put(jax.device_get(state), self._replicated)

    def place_batch(self, batch):
        """This process's rows of a global batch, one contiguous slice per local device (process
        p's slices are devices p*L .. p*L+L-1 of the global device axis)."""
        local = self._local_count

        def split(x):
            x = np.asarray(x)
            check_rows_divide(x.shape[0], local)
            slices = x.reshape(local, x.shape[0] // local, *x.shape[1:])
            return jax.make_array_from_process_local_data(
                self._per_device, slices, (self.num_devices, *slices.shape[1:])
            )

        return jax.tree.map(split, batch)

    def global_state(self, state: TrainState) -> TrainState:
        """`state` as arrays over every device of every process (for orbax): across processes,
        pmap returns each process's replicas as arrays of its own devices; this joins them,
        without copying, into one replicated global array per leaf."""
        if jax.process_count() == 1:
            return state

        def join(x):
            if x.sharding == self._replicated:
                return x
            buffers = [shard.data for shard in x.addressable_shards]
            return jax.make_array_from_single_device_arrays(x.shape, self._replicated, buffers)

        return jax.tree.map(join, state)

    def host_state(self, state: TrainState) -> TrainState:
        """The state as host numpy arrays (read from the first replica, no gather)."""
        return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), state)

    # ---------------------------------------------------------------------------- steps
    def train_step(self, state: TrainState, batch):
        return self._train_step(state, batch)

    def eval_step(self, state: TrainState, batch):
        return self._eval_step(state, batch)

    def lower_train_step(self, state, batch):
        return self._train_step.lower(state, batch)

    def state_shardings(self) -> TrainState:
        return jax.tree.map(lambda _: self._replicated, self._abstract_state)

    def layout(self):
        """Everything replicated: the state, and the averaged gradients."""
        state = self._abstract_state
        return jax.tree.map(lambda _: P(), state), jax.tree.map(lambda _: P(), state.params)

    def abstract_batch(self, batch):
        """ShapeDtypeStructs of a placed global batch: one leading slice per device."""
        n = self.num_devices
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (n, x.shape[0] // n, *x.shape[1:]), x.dtype, sharding=self._per_device
            ),
            batch,
        )
