"""jddp: data-parallel training of Flax models in JAX.

trainer = jddp.Trainer(model, loss_fn, optax.adam(1e-3))   # DDP over all local devices
state = trainer.init(seed=0, sample_batch=batch)
state, metrics = trainer.step(state, batch)                  # batch = one *global* batch
state = jddp.fit(trainer, batches, workdir="runs/a", num_steps=1000)  # or the whole loop

`model` is a Flax Linen or NNX module; a BatchNorm with `axis_name="batch"` averages over the
whole global batch under every strategy. `mesh="data:2,fsdp:2,tensor:2"` (with partition `rules`)
lays the mesh strategies out over replicas, ZeRO shards and tensor parallelism.
"""

from jddp import losses
from jddp.checkpoints.save_restore import restore, save
from jddp.core.lora import LoRA
from jddp.core.loss_scale import DynamicLossScale
from jddp.core.state import TrainState
from jddp.core.task import Task
from jddp.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    JddpError,
    ShapeError,
    TrainingHalted,
    UsageError,
    WorkdirError,
)
from jddp.loop import fit
from jddp.parallel.mesh import DeviceMesh
from jddp.parallel.strategies import STRATEGIES, batch_axis_name, device_mesh_for
from jddp.run.config import default_config
from jddp.runtime.processes import initialize
from jddp.runtime.rollback import RollbackPolicy
from jddp.trainer import PlacedBatch, Trainer
from jddp.version import __version__ as __version__

__all__ = [
    "STRATEGIES",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DeviceMesh",
    "DynamicLossScale",
    "JddpError",
    "LoRA",
    "PlacedBatch",
    "RollbackPolicy",
    "ShapeError",
    "Task",
    "TrainState",
    "Trainer",
    "TrainingHalted",
    "UsageError",
    "WorkdirError",
    "batch_axis_name",
    "default_config",
    "device_mesh_for",
    "fit",
    "losses",
    "restore",
    "save",
    "initialize",
]
