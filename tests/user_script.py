"""A user's training script, as the multi-host docs tell one to write it: its own Flax model, its
own numpy data, `jddp.fit`; nothing of jddp's internals. It runs unchanged as one process and
under any launcher (tests/test_any_launcher.py).

    python tests/user_script.py WORKDIR [STRATEGY]

Process 0 writes the final parameters to WORKDIR/params.npz and prints the mesh, the process of
each of its devices and the shape of its first device's shard of the first kernel. With
USER_SCRIPT_KILL_MARKER set, process 1 of a job kills itself (SIGKILL) the first time it draws
batch 11, and creates that file, so that a rerun goes through.
"""

import os
import signal
import sys

import flax.linen as nn
import jax
import numpy as np
import optax

import jddp

STEPS, GLOBAL_BATCH = 16, 32


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.tanh(nn.Dense(64)(x)))


def global_batches(inputs, labels):
    """Endless global batches, the same in every process."""
    rng = np.random.default_rng(1)
    for index in range(10**9):
        marker = os.environ.get("USER_SCRIPT_KILL_MARKER")
        if marker and index == 11 and jax.process_index() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        rows = rng.choice(len(inputs), GLOBAL_BATCH, replace=False)
        yield {"image": inputs[rows], "label": labels[rows]}


def main(workdir, strategy="hybrid"):
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(512, 16)).astype(np.float32)
    labels = (inputs[:, :4].argmax(axis=1)).astype(np.int32)
    trainer = jddp.Trainer(Net(), jddp.losses.softmax_cross_entropy, optax.adam(1e-2),
                           strategy=strategy, min_shard_size=1)  # fmt: skip
    batches = map(trainer.process_rows, global_batches(inputs, labels))
    state = jddp.fit(trainer, batches, workdir=workdir, num_steps=STEPS, checkpoint_every=8,
                     log_every=4)  # fmt: skip
    mesh = trainer.device_mesh
    processes = np.vectorize(lambda d: d.process_index)(mesh.mesh.devices).tolist()
    shard = state.params["Dense_0"]["kernel"].addressable_shards[0].data.shape
    params = trainer.host_state(state).params
    if jax.process_index() == 0:
        print("mesh", mesh.describe(), "processes", processes, "shard", shard, flush=True)
        leaves = jax.tree_util.tree_leaves_with_path(params)
        flat = {"/".join(k.key for k in path): leaf for path, leaf in leaves}
        np.savez(os.path.join(workdir, "params.npz"), **flat)


if __name__ == "__main__":
    main(*sys.argv[1:])
