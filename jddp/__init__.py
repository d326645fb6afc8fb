"""jddp: data-parallel training of Flax models in JAX.

trainer = jddp.Trainer(model, loss_fn, optax.adam(1e-3))   # DDP over all local devices
state = trainer.init(seed=0, sample_batch=batch)
state, metrics = trainer.step(state, batch)                  # batch = one *global* batch

`model` is a Flax Linen or NNX module; for BatchNorm over the whole global batch, build it with
`axis_name=jddp.batch_axis_name(strategy)`.
"""

from jddp import losses
from jddp.config import default_config
from jddp.core import Task
from jddp.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    JddpError,
    ShapeError,
    TrainingHalted,
    WorkdirError,
)
from jddp.state import TrainState
from jddp.strategies import STRATEGIES, batch_axis_name
from jddp.trainer import PlacedBatch, Trainer

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "JddpError",
    "PlacedBatch",
    "ShapeError",
    "Task",
    "TrainState",
    "Trainer",
    "TrainingHalted",
    "WorkdirError",
    "batch_axis_name",
    "default_config",
    "losses",
]
