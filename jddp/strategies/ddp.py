"""DDP on `jax.pmap`: a full replica of the state per device, gradients averaged with `lax.pmean`.

The state is one array per leaf, replicated on every device (`NamedSharding(mesh, P())`), and
crosses the pmap boundary with `in_axes=None` / `out_axes=None`; batches carry a leading axis of
one slice per device. Stacking replicas along a leading axis instead (the textbook pmap layout)
makes XLA copy the optimizer state in and out of every step: 18 copies for Adam on an MLP, and
a third fewer examples/s at 8 devices (experiments/bench/ddp_overhead.py).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.core import Task, jit_init
from jddp.errors import ShapeError
from jddp.state import TrainState

AXIS = "batch"


class DDP:
    """Replicated state, one slice of every global batch per device, identical updates."""

    name = "ddp"
    # The pmap axis a model's BatchNorm names to average its statistics over the global batch
    # (`nn.BatchNorm(axis_name=...)`, PyTorch's SyncBatchNorm). A class attribute: models are
    # built before the strategy. Mesh strategies have None (under jit the batch is one array).
    batch_axis_name = AXIS

    def __init__(self, task: Task, devices: Sequence[jax.Device] | None = None):
        self.task = task
        self.devices = list(devices) if devices is not None else jax.local_devices()
        mesh = Mesh(np.array(self.devices), (AXIS,))
        self._replicated = NamedSharding(mesh, P())
        self._per_device = NamedSharding(mesh, P(AXIS))
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
        grads, metrics, model_state = self.task.local_grads(state, batch, rng)
        grads, metrics = lax.pmean((grads, metrics), AXIS)
        # Keeps replicas identical when a BatchNorm without axis_name computed per-device
        # statistics; synchronized BatchNorm's statistics already agree (this changes nothing).
        model_state = jax.tree.map(_mean_if_float, model_state)
        return self.task.apply_gradients(state, grads, model_state, metrics)

    def _eval(self, state: TrainState, batch):
        return lax.psum(self.task.eval_sums(state, batch), AXIS)

    # ----------------------------------------------------------------------- placement
    def init_state(self, seed: int, sample_input) -> TrainState:
        """Initialize once from `seed`, then place the same state on every device."""
        state = jit_init(self.task.init_state, jax.random.key(seed), sample_input)
        return self.place_state(state)

    def place_state(self, state: TrainState) -> TrainState:
        """One full copy of `state` on every device."""
        return jax.device_put(state, self._replicated)

    def place_batch(self, batch):
        """Split a batch along its first axis into one contiguous slice per device."""
        n = self.num_devices

        def split(x):
            x = np.asarray(x)
            if x.shape[0] % n:
                raise ShapeError(
                    f"a batch of {x.shape[0]} examples does not split over {n} devices; "
                    f"use a multiple of {n}"
                )
            return jax.device_put(x.reshape(n, x.shape[0] // n, *x.shape[1:]), self._per_device)

        return jax.tree.map(split, batch)

    def host_state(self, state: TrainState) -> TrainState:
        """The state as host numpy arrays (read from the first replica, no gather)."""
        return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), state)

    # ---------------------------------------------------------------------------- steps
    def train_step(self, state: TrainState, batch):
        return self._train_step(state, batch)

    def eval_step(self, state: TrainState, batch):
        return self._eval_step(state, batch)


def _mean_if_float(x):
    return lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.floating) else x
