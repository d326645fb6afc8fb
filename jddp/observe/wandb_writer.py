"""The Weights & Biases writer (`pip install 'jddp[wandb]'`): one W&B run per workdir, its id
kept in WORKDIR/trackers.json so a resumed run logs on to the same W&B run. W&B's own
environment variables apply (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE=offline, WANDB_DIR; its
files go to WORKDIR/wandb unless WANDB_DIR says otherwise)."""

import os
from collections.abc import Mapping

from jddp.errors import ConfigError, RetryableError, first_line
from jddp.observe import writers


class WandbWriter:
    """Scalars and config to a W&B run, resumed by id when the workdir names one. W&B keeps the
    first value it received for a step: after a rollback, or a resume behind the last record,
    the steps written again keep their first values (the same losses, a resume being exact)."""

    def __init__(self, workdir: str):
        import wandb

        run_id = writers.stored_run_id(workdir, "wandb")
        try:
            self._run = wandb.init(
                project=writers.project_name("WANDB_PROJECT"),
                name=os.path.basename(os.path.abspath(workdir)),
                dir=os.environ.get("WANDB_DIR") or workdir,
                id=run_id,
                resume="allow",
                reinit="create_new",  # a run the user's program holds stays its own
            )
        except wandb.errors.Error as e:
            offline = "run `wandb login`, or set WANDB_MODE=offline to log without an account"
            if isinstance(e, wandb.errors.CommError) and not isinstance(
                e, wandb.errors.AuthenticationError
            ):
                raise RetryableError(
                    f"W&B could not start a run: {first_line(e)}; run the same command again "
                    "to resume"
                ) from None
            raise ConfigError(f"W&B could not start a run: {first_line(e)}; {offline}") from None
        if run_id is None:
            writers.store_run_id(workdir, "wandb", self._run.id)

    def write_config(self, config: Mapping) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def rewind(self, step: int) -> None:
        pass  # W&B keeps what it has; see the class

    def close(self) -> None:
        self._run.finish()


def open_writer(workdir: str, start_step: int) -> WandbWriter:
    return WandbWriter(workdir)
