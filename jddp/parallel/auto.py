"""`auto`: ZeRO-3's layout, the compiler's collectives.

The state is laid out exactly as under zero3 (parameters and optimizer state split over `fsdp`
by the partition rules, over `tensor` where a rule says; the same bytes per device and the same
checkpoints), but the step is one `jax.jit` over the global batch with no hand-written
collective: XLA's SPMD partitioner decides per operation whether to gather weights or move
activations, as in a hand-written sharded `jit` (MaxText's way). With few rows per device,
moving activations is the cheaper choice, which zero3's fixed all-gather of every weight cannot
make (experiments/bench/sharded_jit.py).

The program still computes what the per-device strategies compute (jddp/core/slices.py): the
batch axes' names are bound, so BatchNorm's statistics are the whole batch's; micro-batches take
each slice's next rows; every example draws its own dropout mask. The result is one device's.
"""

import jax
from jax.sharding import NamedSharding

from jddp.core.slices import Slices
from jddp.core.state import TrainState
from jddp.core.task import Task
from jddp.errors import ConfigError
from jddp.parallel.mesh import DeviceMesh
from jddp.parallel.zero import ZeroStrategy


class AutoStrategy(ZeroStrategy):
    """zero3's state on a mesh of `data`, `fsdp` and `tensor` axes; XLA picks the collectives."""

    def __init__(self, task: Task, mesh: DeviceMesh, **options):
        """`options` as ZeroStrategy's: `rules`, `min_shard_size`, `pipeline`, `grad_comm`."""
        if mesh.stage_axis:
            raise ConfigError(
                f"parallel.strategy=auto does not run pipelines (parallel.mesh "
                f"{mesh.describe()!r} has a stage axis); use zero1, zero2 or zero3 with a stage "
                "axis, or auto without one"
            )
        if mesh.context_axis:
            raise ConfigError(
                f"parallel.strategy=auto does not run context parallelism (parallel.mesh "
                f"{mesh.describe()!r} has a context axis); use zero1, zero2 or zero3 with a "
                "context axis, or auto without one"
            )
        grad_comm = options.get("grad_comm")
        if grad_comm is not None and grad_comm.dtype != "float32":
            raise ConfigError(
                f"parallel.grad_comm_dtype={grad_comm.dtype} does not apply to auto (XLA chooses "
                "its collectives, in the gradients' dtype); use zero2 or zero3 to reduce "
                "gradients in bfloat16, or leave grad_comm_dtype=float32"
            )
        super().__init__(task, mesh, name="auto", **options)
        self._slices = Slices(self.batch_axes, mesh.batch_slices)

    def _train(self, state: TrainState, batch):
        grads, totals, model_state = self.task.local_grads(
            state.params,
            state.model_state,
            batch,
            state.step_key(),
            loss_scale=state.loss_scale,
            slices=self._slices,
        )
        # Averaged gradients in zero3's layout: each device updates only the shard it holds.
        grad_shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._grad_specs)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        return self.task.apply_gradients(state, grads, model_state, totals)

    def _eval(self, state: TrainState, batch):
        return self._slices.bind(self.task.eval_sums)(state.params, state.model_state, batch)
