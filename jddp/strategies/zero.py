"""ZeRO-1/2/3 and hybrid sharding on a `jax.sharding.Mesh`.

Each step is one `jax.jit` with explicit in/out shardings and donated state. Inside it a
`shard_map` runs the shared core on every device's slice of the batch and performs exactly the
collectives of the stage, written out (XLA:CPU would turn a sharding constraint into an
all-reduce plus a slice); the optimizer update then runs at the jit level on sharded arrays, so
global-norm clipping sees the whole gradient and each device updates only what it holds.

    stage   parameters  gradients         optimizer  collectives per step
    zero1   replicated  all-reduced       sharded    all-reduce grads, all-gather params
    zero2   replicated  reduce-scattered  sharded    reduce-scatter grads, all-gather params
    zero3   sharded     reduce-scattered  sharded    all-gather params, reduce-scatter grads
    hybrid  zero3 over the mesh's last axis (`shard`), replicated over the others (`replica`)

`fsdp` is another name for `zero3`. The batch is split over every mesh axis.
"""

from collections.abc import Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.core import Task, check_rows_divide, init_compiler_options
from jddp.sharding.mesh import build_mesh
from jddp.sharding.rules import mirror_specs, param_specs, validate_rules
from jddp.state import TrainState
from jddp.strategies.collectives import fused_pmean, spec_axes
from jddp.strategies.compression import GradComm

# stage -> (parameters sharded, gradients sharded)
STAGES = {
    "zero1": (False, False),
    "zero2": (False, True),
    "zero3": (True, True),
    "hybrid": (True, True),
}
DEFAULT_MIN_SHARD_SIZE = 2**12  # elements; smaller tensors stay replicated under "fsdp"


def default_mesh_spec(stage: str) -> str:
    # Hybrid shards within a host and replicates across hosts (FSDP's HYBRID_SHARD).
    return f"replica:{jax.process_count()},shard:-1" if stage == "hybrid" else "data:-1"


class ZeroStrategy:
    """One ZeRO stage (or hybrid) over `devices` (default: every device of every process)."""

    def __init__(
        self,
        task: Task,
        devices: Sequence[jax.Device] | None = None,
        *,
        stage: str,
        mesh: str | None = None,
        rules: Sequence[tuple[str, str]] = (),
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        grad_comm: GradComm | None = None,
    ):
        self.name = stage
        self.task = task
        self.grad_comm = grad_comm or GradComm()
        self.mesh = build_mesh(mesh or default_mesh_spec(stage), devices or jax.devices())
        self.data_axes = tuple(self.mesh.axis_names)
        self.shard_axes = self.data_axes[-1:] if stage == "hybrid" else self.data_axes
        self.shard_params, self.shard_grads = STAGES[stage]
        self.rules = validate_rules(rules, self.mesh)
        self.min_shard_size = min_shard_size
        # SyncBatchNorm inside the per-device program reduces over these axes.
        self.batch_axis_name = self.data_axes
        self._replicated = NamedSharding(self.mesh, P())
        self._batch_sharding = NamedSharding(self.mesh, P(self.data_axes))
        self._programs_for = None

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    # ---------------------------------------------------------------------------- layout
    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs of every state leaf under this stage (state may be abstract)."""
        specs = param_specs(
            state.params, self.rules, self.mesh, self.shard_axes, self.min_shard_size
        )
        replicated = jax.tree.map(lambda _: P(), state.params)
        return TrainState(
            step=P(),
            params=specs if self.shard_params else replicated,
            opt_state=mirror_specs(state.opt_state, state.params, specs),
            model_state=jax.tree.map(lambda _: P(), state.model_state),
            rng=P(),
            nonfinite_steps=P(),
            comm_state=jax.tree.map(lambda _: P(), state.comm_state),
        )

    def state_shardings(self, state: TrainState):
        """NamedShardings of every state leaf (state may be abstract)."""
        self._programs(state)
        return self._state_shardings

    def layout(self, state: TrainState) -> tuple[TrainState, object]:
        """(PartitionSpecs of the state, PartitionSpecs of the reduced gradients)."""
        self._programs(state)
        return self._specs, self._grad_specs

    def abstract_inputs(self, state: TrainState, batch):
        """ShapeDtypeStructs with this strategy's shardings, for lowering without data."""
        self._programs(state)
        return (
            jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                state,
                self._state_shardings,
            ),
            jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._batch_sharding),
                batch,
            ),
        )

    def _programs(self, state: TrainState):
        """The jitted steps for states shaped like `state`, built once."""
        structure = jax.tree.structure(state), tuple(np.shape(x) for x in jax.tree.leaves(state))
        if self._programs_for != structure:
            self._specs = self.state_specs(state)
            self._grad_specs = param_specs(
                state.params, self.rules, self.mesh, self.shard_axes, self.min_shard_size
            )
            if not self.shard_grads:
                self._grad_specs = jax.tree.map(lambda _: P(), self._grad_specs)
            self._state_shardings = jax.tree.map(
                lambda spec: NamedSharding(self.mesh, spec), self._specs
            )
            self._train_step = jax.jit(
                self._train,
                in_shardings=(self._state_shardings, self._batch_sharding),
                out_shardings=(self._state_shardings, self._replicated),
                donate_argnums=0,
            )
            self._eval_step = jax.jit(
                self._eval,
                in_shardings=(self._state_shardings, self._batch_sharding),
                out_shardings=self._replicated,
            )
            self._programs_for = structure
        return self._train_step, self._eval_step

    # ------------------------------------------------------------ per-device programs
    def _gather_params(self, params):
        return jax.tree.map(self.grad_comm.gather, params, self._specs.params)

    def _reduce_grads(self, grads):
        """Per-device gradients to the mean over all devices, laid out as `_grad_specs`."""
        count = self.num_devices

        def reduce(grad, spec):
            if not self.shard_params:  # zero3 got the reduce-scatter from AD of the gather
                grad = self.grad_comm.scatter_sum(grad, spec)
            rest = tuple(a for a in self.data_axes if a not in spec_axes(spec))
            return (self.grad_comm.psum(grad, rest) if rest else grad) / count

        return jax.tree.map(reduce, grads, self._grad_specs)

    def _per_device_grads(self, params, model_state, step_key, batch):
        rng = jax.random.fold_in(step_key, lax.axis_index(self.data_axes))
        params_fn = self._gather_params if self.shard_params else None
        grads, metrics, model_state = self.task.local_grads(
            params, model_state, batch, rng, params_fn
        )
        model_state = fused_pmean(model_state, self.data_axes)
        return self._reduce_grads(grads), lax.pmean(metrics, self.data_axes), model_state

    def _train(self, state: TrainState, batch):
        grads, metrics, model_state = jax.shard_map(
            self._per_device_grads,
            mesh=self.mesh,
            in_specs=(self._specs.params, self._specs.model_state, P(), P(self.data_axes)),
            out_specs=(self._grad_specs, P(), self._specs.model_state),
            # Per-device gradients as under pmap: every collective is written out above.
            check_vma=False,
        )(state.params, state.model_state, state.step_key(), batch)
        return self.task.apply_gradients(state, grads, model_state, metrics)

    def _eval(self, state: TrainState, batch):
        def per_device(params, model_state, batch):
            if self.shard_params:
                params = self._gather_params(params)
            return lax.psum(self.task.eval_sums(params, model_state, batch), self.data_axes)

        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(self._specs.params, self._specs.model_state, P(self.data_axes)),
            out_specs=P(),
            check_vma=False,
        )(state.params, state.model_state, batch)

    # ----------------------------------------------------------------------- placement
    def init_state(self, seed: int, sample_input) -> TrainState:
        """Initialize directly into the shardings: no device ever holds the whole sharded state."""
        compiled = self.lower_init(seed, sample_input).compile(init_compiler_options())
        return compiled(jax.random.key(seed), sample_input)

    def lower_init(self, seed: int, sample_input):
        """The initialization lowered with the state's shardings as its output shardings.

        With JAX's partitionable threefry each device draws only its own shard, and the values
        equal an unsharded initialization from the same seed."""
        key = jax.random.key(seed)
        self._programs(jax.eval_shape(self.task.init_state, key, sample_input))
        return jax.jit(self.task.init_state, out_shardings=self._state_shardings).lower(
            key, sample_input
        )

    def place_state(self, state: TrainState) -> TrainState:
        self._programs(state)
        return jax.device_put(state, self._state_shardings)

    def place_batch(self, batch):
        """This process's rows of a global batch, as global arrays split over every device."""
        local = len(self.mesh.local_devices)

        def place(x):
            x = np.asarray(x)
            check_rows_divide(x.shape[0], local)
            return jax.make_array_from_process_local_data(self._batch_sharding, x)

        return jax.tree.map(place, batch)

    def global_state(self, state: TrainState) -> TrainState:
        return state  # jit's outputs already span every process's devices

    def consolidate(self, state: TrainState) -> TrainState:
        return state  # no per-device state: PowerSGD runs under ddp only

    def host_state(self, state: TrainState) -> TrainState:
        """The whole state as host numpy arrays (gathered from the shards)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.process_allgather(state, tiled=True)
        return jax.device_get(state)

    # ---------------------------------------------------------------------------- steps
    def train_step(self, state: TrainState, batch):
        return self._programs(state)[0](state, batch)

    def eval_step(self, state: TrainState, batch):
        return self._programs(state)[1](state, batch)

    def lower_train_step(self, state, batch):
        """The step lowered for `state` and `batch` (arrays or ShapeDtypeStructs)."""
        return self._programs(state)[0].lower(state, batch)
