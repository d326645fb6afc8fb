"""jddp: data-parallel training of Flax models in JAX.

trainer = jddp.Trainer(model, loss_fn, optax.adam(1e-3))   # DDP over all local devices
state = trainer.init(seed=0, sample_batch=batch)
state, metrics = trainer.step(state, batch)                  # batch = one *global* batch
state = jddp.fit(trainer, batches, workdir="runs/a", num_steps=1000)  # or the whole loop

`model` is a Flax Linen or NNX module; a BatchNorm with `axis_name="batch"` averages over the
whole global batch under every strategy. `mesh="data:2,fsdp:2,tensor:2"` (with partition `rules`)
lays the mesh strategies out over replicas, ZeRO shards and tensor parallelism.
"""

import importlib
from typing import TYPE_CHECKING

from jddp.version import __version__ as __version__

# Each public name, by the module it lives in, is imported on its first use (PEP 562): a program
# that needs only a light part of jddp, such as the launcher `jddp-launch` (it supervises
# processes and never imports JAX), starts without importing JAX, TFDS and orbax (about 1.5 s of
# CPU per process on a 2-core machine).
_PUBLIC = {
    "jddp.checkpoints.save_restore": ("restore", "save"),
    "jddp.core.lora": ("LoRA",),
    "jddp.core.loss_scale": ("DynamicLossScale",),
    "jddp.core.state": ("TrainState",),
    "jddp.core.task": ("Task",),
    "jddp.errors": (
        "CheckpointError",
        "ConfigError",
        "DataError",
        "JddpError",
        "ShapeError",
        "TrainingHalted",
        "UsageError",
        "WorkdirError",
    ),
    "jddp.loop": ("fit",),
    "jddp.parallel.mesh": ("DeviceMesh",),
    "jddp.parallel.strategies": ("STRATEGIES", "batch_axis_name", "device_mesh_for"),
    "jddp.run.config": ("default_config",),
    "jddp.runtime.processes": ("initialize",),
    "jddp.runtime.rollback": ("RollbackPolicy",),
    "jddp.trainer": ("PlacedBatch", "Trainer"),
}
_HOME = {name: module for module, names in _PUBLIC.items() for name in names}

if TYPE_CHECKING:  # the same names, as type checkers and the API reference read them
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


def __getattr__(name: str):
    """A public name, or a subpackage (`jddp.data`), imported on first use."""
    if name.startswith("__"):  # probes for `__wrapped__`, `__file__`...: not a module
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise  # a module the subpackage imports is missing: say that
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})


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
