"""DDP on `jax.pmap`: a full replica of the state per device, gradients averaged with `lax.pmean`.

The state is one array per leaf, replicated on every device (`NamedSharding(mesh, P())`), and
crosses the pmap boundary with `in_axes=None` / `out_axes=None`; batches carry a leading axis of
one slice per device. Stacking replicas along a leading axis instead (the textbook pmap layout)
makes XLA copy the optimizer state in and out of every step: 18 copies for Adam on an MLP, and
a third fewer examples/s at 8 devices (experiments/bench/ddp_overhead.py).
"""

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.core.state import TrainState
from jddp.core.task import Task, check_rows_divide, init_key, jit_init
from jddp.errors import ConfigError
from jddp.parallel.grad_reduction import GradComm
from jddp.parallel.mesh import DDP_AXIS as AXIS
from jddp.parallel.mesh import DeviceMesh


class CompiledAhead:
    """A pmapped program called through its ahead-of-time compiled executable: pmap's own call
    spends about 40 us of Python on every step (checking and reshaping its arguments, about 2% of
    a 2 ms step), the executable's C++ call a few. The first call compiles for its arguments; a
    call whose arguments the executable refuses (other shapes, dtypes or placement, checked
    before anything runs or is donated) goes through pmap, which handles any."""

    def __init__(self, mapped):
        self.mapped = mapped
        self._compiled = None

    def __call__(self, *args):
        if self._compiled is None:
            self._compiled = self.mapped.lower(*args).compile()
        try:
            return self._compiled(*args)
        except (TypeError, ValueError):
            return self.mapped(*args)

    def lower(self, *args):
        return self.mapped.lower(*args)


class DDP:
    """Replicated state, one slice of every global batch per device, identical updates."""

    name = "ddp"
    pipeline = None  # no stage axis: every device runs the whole model
    context_axis = None  # nor a context axis: every device holds whole sequences

    def __init__(self, task: Task, mesh: DeviceMesh, grad_comm: GradComm | None = None):
        if mesh.axis_names != (AXIS,):
            raise ConfigError(
                f"parallel.mesh {mesh.describe()!r} does not apply to ddp (every device holds a "
                "full replica); use zero1, zero2, zero3 or hybrid, or leave it empty"
            )
        self.task = task
        self.device_mesh = mesh
        self.mesh = mesh.mesh  # placement only; pmap maps over its devices
        # Every device of every process; each process feeds and reads its local ones.
        self.devices = list(self.mesh.devices.flat)
        # The collectives' implementation, for these devices' platform, chosen once.
        self.grad_comm = (grad_comm or GradComm()).on(self.devices)
        self._local_count = sum(d.process_index == jax.process_index() for d in self.devices)
        self._replicated = NamedSharding(self.mesh, P())
        self._per_device = NamedSharding(self.mesh, P(AXIS))
        # PowerSGD's error feedback differs between devices: it goes in and out of the step as
        # an argument of its own, mapped (pmap's axes must be hashable across processes).
        if self.grad_comm.powersgd:
            rows = np.zeros((self._local_count, 1), np.float32)
            self._device_rows = jax.make_array_from_process_local_data(
                self._per_device, rows, (self.num_devices, 1)
            )
            self._spread = jax.pmap(
                lambda x, _: x, AXIS, devices=self.devices, in_axes=(None, 0), out_axes=0
            )
            self._average = jax.pmap(
                lambda x: lax.pmean(x, AXIS), AXIS, devices=self.devices, out_axes=None
            )
        self._train_step = CompiledAhead(
            jax.pmap(
                self._train,
                AXIS,
                devices=self.devices,
                in_axes=(None, 0, 0),
                out_axes=(None, 0, None),
                donate_argnums=(0, 1),
            )
        )
        self._eval_step = jax.pmap(
            self._eval, AXIS, devices=self.devices, in_axes=(None, 0), out_axes=None
        )

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    # ------------------------------------------------------------ per-device programs
    def _train(self, state: TrainState, device_errors, batch):
        state = self._with_errors(state, device_errors)
        rng = self.task.slice_key(state.step_key(), lax.axis_index(AXIS), batch)
        grads, metrics, model_state = self.task.local_grads(
            state.params, state.model_state, batch, rng, loss_scale=state.loss_scale
        )
        grads, (metrics, model_state), comm_state = self.grad_comm.mean(
            grads, (metrics, model_state), state.comm_state, AXIS, state.step
        )
        state, metrics = self.task.apply_gradients(state, grads, model_state, metrics, comm_state)
        return *self._split_errors(state), metrics

    def _eval(self, state: TrainState, batch):
        return lax.psum(self.task.eval_sums(state.params, state.model_state, batch), AXIS)

    # ----------------------------------------------------------------------- placement
    def prepare(self, abstract_state: TrainState, stack=None) -> None:
        """Everything is replicated: the programs do not depend on the state's shapes (nor on
        where a stack of layers is: ddp has no stage axis)."""
        self._abstract_state = abstract_state

    def init_state(self, seed: int, sample_input) -> TrainState:
        """Initialize once from `seed`, then place the same state on every device."""
        state = jit_init(self.task.init_state, init_key(seed), sample_input)
        return self.place_state(state)

    def lower_init(self, seed: int, sample_input):
        return jax.jit(self.task.init_state).lower(init_key(seed), sample_input)

    def place_state(self, state: TrainState) -> TrainState:
        """One full copy of `state` on every device.

        From host arrays: across processes JAX then also checks that every process passes the
        same values, and device_put of a device array to this sharding built a broken array
        with one local device per process (jax 0.10.2)."""
        return jax.device_put(jax.device_get(state), self._replicated)

    def row_block(self) -> tuple[int, int]:
        return jax.process_index(), jax.process_count()  # every device has its own slice

    def place_batch(self, batch):
        """This process's rows of a global batch, one contiguous slice per local device (process
        p's slices are devices p*L .. p*L+L-1 of the global device axis)."""
        local = self._local_count

        def split(x):
            x = np.asarray(x)
            check_rows_divide(x.shape[0], local)
            return x.reshape(local, x.shape[0] // local, *x.shape[1:])

        slices = jax.tree.map(split, batch)
        if self.num_devices == 1:  # the same placement, for about half the Python per step
            return jax.device_put(slices, self.devices[0])
        shapes = jax.tree.map(lambda x: (self.num_devices, *x.shape[1:]), slices)
        # One call for the whole batch: on one process, one device_put of every entry.
        return jax.make_array_from_process_local_data(self._per_device, slices, shapes)

    def global_state(self, state: TrainState) -> TrainState:
        """`state` as arrays over every device of every process (for orbax): across processes,
        pmap returns each process's replicas as arrays of its own devices; this joins them,
        without copying, into one replicated global array per leaf."""
        state = self.consolidate(state)
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
        state = self.consolidate(state)
        return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), state)

    # ------------------------------------------------------------- PowerSGD's errors
    def _device_errors(self, state: TrainState) -> bool:
        errors = jax.tree.leaves(state.comm_state.get("error", {}))
        return bool(errors) and errors[0].ndim == 3

    def consolidate(self, state: TrainState) -> TrainState:
        """`state` with PowerSGD's per-device errors replaced by their mean, replicated: the
        only part of them later steps depend on, and what a checkpoint holds. One all-reduce
        of the errors; `state` itself otherwise."""
        if not self._device_errors(state):
            return state
        return self._with_errors(state, self._average(state.comm_state["error"]))

    def _spread_errors(self, state: TrainState) -> TrainState:
        """A consolidated (or fresh) state's mean error copied to every device as its own."""
        if not self.grad_comm.powersgd or self._device_errors(state):
            return state
        return self._with_errors(state, self._spread(state.comm_state["error"], self._device_rows))

    def _split_errors(self, state: TrainState):
        """(`state` without PowerSGD's errors, the errors): {} for the errors without it."""
        if not self.grad_comm.powersgd:
            return state, {}
        rest = {k: v for k, v in state.comm_state.items() if k != "error"}
        return state.replace(comm_state=rest), state.comm_state["error"]

    def _with_errors(self, state: TrainState, errors) -> TrainState:
        if not self.grad_comm.powersgd:
            return state
        return state.replace(comm_state={**state.comm_state, "error": errors})

    def _error_shapes(self, state: TrainState) -> TrainState:
        """`state` as `_spread_errors` would make it, as shapes (for lowering without data)."""
        if not self.grad_comm.powersgd or self._device_errors(state):
            return state
        local = (self._local_count,)  # pmap lowers abstract inputs as this process's part
        errors = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(local + x.shape, x.dtype), state.comm_state["error"]
        )
        return self._with_errors(state, errors)

    # ---------------------------------------------------------------------------- steps
    def train_step(self, state: TrainState, batch):
        state, errors, metrics = self._train_step(
            *self._split_errors(self._spread_errors(state)), batch
        )
        return self._with_errors(state, errors), metrics

    def eval_step(self, state: TrainState, batch):
        return self._eval_step(state.replace(comm_state={}), batch)  # no per-device errors

    def lower_train_step(self, state, batch):
        """The step lowered for `state` and `batch`: arrays, or ShapeDtypeStructs (pmap takes
        no mix of the two across processes)."""
        abstract = not isinstance(jax.tree.leaves(state)[0], jax.Array)
        state = self._error_shapes(state) if abstract else self._spread_errors(state)
        return self._train_step.lower(*self._split_errors(state), batch)

    def state_shardings(self) -> TrainState:
        return jax.tree.map(lambda _: self._replicated, self._abstract_state)

    def layout(self):
        """Everything replicated: the state, and the averaged gradients (of the trainable
        parameters)."""
        state = self._abstract_state
        grads = self.task.trainable(state.params)
        return jax.tree.map(lambda _: P(), state), jax.tree.map(lambda _: P(), grads)

    def abstract_batch(self, batch):
        """ShapeDtypeStructs of a placed global batch: one leading slice per device."""
        n = self.num_devices
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (n, x.shape[0] // n, *x.shape[1:]), x.dtype, sharding=self._per_device
            ),
            batch,
        )
