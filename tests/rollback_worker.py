"""One process of tests/test_rollback.py's two-process job (started by jddp-launch): fits the
reference SmallNet with `nan_policy=rollback` on this process's rows of the reference batches, of
which process 1's rows of batch 7 are NaN; process 0 writes the initial and final parameters and
the logged losses to ARGV[1] (.npz). ARGV[2]: the workdir."""

import json
import os
import sys

from jddp.runtime import processes as runtime

runtime.initialize()  # from the JDDP_* variables jddp-launch sets

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jddp  # noqa: E402
from jddp.checkpoints.compatibility import shapes_by_path  # noqa: E402
from tests.reference import SmallNet, make_batches, optimizer_for, per_example_ce  # noqa: E402

POISONED, STEPS, EVERY = 7, 14, 4


def flat(tree) -> dict[str, np.ndarray]:
    return dict(zip(shapes_by_path(tree), map(np.asarray, jax.tree.leaves(tree)), strict=True))


def main(out: str, workdir: str) -> None:
    trainer = jddp.Trainer(SmallNet(), per_example_ce, optimizer_for(clip=True))
    part, parts = trainer.row_block
    batches = make_batches()
    rows = len(batches[0]["label"]) // parts
    mine = [{k: v[part * rows : (part + 1) * rows].copy() for k, v in b.items()} for b in batches]
    if part == 1:
        mine[POISONED - 1]["image"][:] = np.nan
    initial = trainer.host_state(trainer.init(seed=0, sample_batch=mine[0])).params
    state = jddp.fit(
        trainer,
        iter(mine),
        workdir=workdir,
        num_steps=STEPS,
        log_every=1,
        checkpoint_every=EVERY,
        rollback=jddp.RollbackPolicy(),
    )
    final = trainer.host_state(state).params
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
        np.savez(
            out,
            losses=np.array(losses),
            **{f"initial/{k}": v for k, v in flat(initial).items()},
            **{f"final/{k}": v for k, v in flat(final).items()},
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
