"""The export: a run's parameters saved as host numpy arrays with orbax, an inference checkpoint
that no strategy, mesh or device count is needed to read (`WORKDIR/export`)."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def export_params(directory: str, params) -> None:
    """Saves `params` as host numpy arrays: an inference checkpoint no strategy is needed for."""
    host = jax.tree.map(np.asarray, params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(directory), host, force=True)
