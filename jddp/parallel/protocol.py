"""The strategy seam: everything the trainer, checkpoints, planner and experiments use of a
strategy, and nothing more. DDP (pmap) and the mesh strategies (ZeRO stages, tensor
parallelism) both fill it; each owns placement and collectives around the shared core
(`jddp.core.task.Task`).

Life of a strategy: built from a task and its devices (the mesh comes first, before the model);
`prepare(abstract_state)` once, when the state's shapes are known, lays the state out and builds
the step programs; then `init_state`, `place_batch`, `train_step` / `eval_step` per step.
"""

from typing import Any, Protocol

import jax
from jax.sharding import Mesh

from jddp.core.layer_stacks import Stack
from jddp.core.state import TrainState
from jddp.parallel.mesh import DeviceMesh
from jddp.parallel.pipeline.engine import Pipeline


class Strategy(Protocol):
    name: str  # the `parallel.strategy` it implements
    device_mesh: DeviceMesh  # its mesh and the roles of the axes (ddp: one `batch` axis)
    mesh: Mesh  # `device_mesh.mesh`, every device it uses: its axis names go in checkpoints
    # The pipeline engine when the mesh has a stage axis (set by `prepare`), else None: its
    # schedule, micro-batches and `describe()` are what the trainer and the run report.
    pipeline: Pipeline | None
    # The mesh axis sequences are cut along (context parallelism), else None.
    context_axis: str | None

    @property
    def num_devices(self) -> int: ...

    def prepare(self, abstract_state: TrainState, stack: Stack | None = None) -> None:
        """Lays out states shaped like `abstract_state` (`Task.abstract_state`), whose model
        holds its `Pipelined` layers at `stack`, and builds the step programs, once."""
        ...

    def state_shardings(self) -> TrainState:
        """NamedShardings of every state leaf (after `prepare`)."""
        ...

    def layout(self) -> tuple[TrainState, Any]:
        """(PartitionSpecs of the state, PartitionSpecs of the averaged gradients: those of
        the trainable parameters, `Task.trainable`)."""
        ...

    def init_state(self, seed: int, sample_input) -> TrainState:
        """A fresh state from `seed`, already placed (after `prepare`)."""
        ...

    def lower_init(self, seed: int, sample_input) -> jax.stages.Lowered: ...

    def row_block(self) -> tuple[int, int]:
        """(block, blocks): this process reads block `block` of `blocks` equal consecutive blocks
        of rows of every global batch (processes along tensor or stage read the same block)."""
        ...

    def place_batch(self, batch) -> Any:
        """This process's rows of a global batch (its `row_block`), on the devices as
        `train_step` takes them."""
        ...

    def abstract_batch(self, batch) -> Any:
        """ShapeDtypeStructs of a placed global batch shaped like `batch` (no data needed)."""
        ...

    def train_step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One step; a state in another layer order than the step holds is reordered first."""
        ...

    def eval_step(self, state: TrainState, batch) -> dict: ...

    def lower_train_step(self, state, batch) -> jax.stages.Lowered:
        """The step lowered for a state and a placed batch (arrays or ShapeDtypeStructs)."""
        ...

    def global_state(self, state: TrainState) -> TrainState:
        """`state` as global arrays over every process's devices, in the model's layer order
        (`TrainState.layer_order` None): what orbax saves."""
        ...

    def host_state(self, state: TrainState) -> TrainState:
        """The whole state as host numpy arrays, in the model's layer order."""
        ...

    def consolidate(self, state: TrainState) -> TrainState:
        """`state` with what differs between devices made the same (PowerSGD's per-device
        errors become their mean): what a checkpoint holds."""
        ...
