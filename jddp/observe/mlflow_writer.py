"""The MLflow writer (`pip install 'jddp[mlflow]'`, the skinny client): one MLflow run per
workdir, its id kept in WORKDIR/trackers.json so a resumed run logs on to the same MLflow run.
The tracking server is MLflow's own setting (MLFLOW_TRACKING_URI: `http://HOST:5000`, or a
local store); the experiment is the project (MLFLOW_EXPERIMENT_NAME, else "jddp")."""

import os
import time
from collections.abc import Mapping

from absl import logging

from jddp.errors import ConfigError, first_line
from jddp.observe import writers

_PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch


class MlflowWriter:
    """Scalars as metrics and the config as parameters (dotted keys) of an MLflow run, resumed
    by id when the workdir names one. MLflow keeps every value: a step written again (after a
    rollback, or a resume behind the last record) holds both, the later one last."""

    def __init__(self, workdir: str):
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException

        self._metric, self._param = Metric, Param
        self._client = client()
        experiment = writers.project_name("MLFLOW_EXPERIMENT_NAME")
        try:
            self._run_id = self._resumed(writers.stored_run_id(workdir, "mlflow"))
            if self._run_id is None:
                found = self._client.get_experiment_by_name(experiment)
                experiment_id = found.experiment_id if found else None
                experiment_id = experiment_id or self._client.create_experiment(experiment)
                run = self._client.create_run(
                    experiment_id, run_name=os.path.basename(os.path.abspath(workdir))
                )
                self._run_id = run.info.run_id
                writers.store_run_id(workdir, "mlflow", self._run_id)
        except MlflowException as e:
            raise _start_error(e) from None

    def _resumed(self, run_id: str | None) -> str | None:
        """`run_id`, set running again, if the tracking server has it; else None."""
        if run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            logging.warning(
                "MLflow run %s of this workdir is not on %s; starting a new one",
                run_id, self._client.tracking_uri,
            )  # fmt: skip
            return None
        return run_id

    def write_config(self, config: Mapping) -> None:
        """The config's keys the run has not recorded yet (MLflow refuses to change one)."""
        have = self._client.get_run(self._run_id).data.params
        params = [
            self._param(key, str(value))
            for key, value in writers.flat_config(config).items()
            if key not in have
        ]
        for first in range(0, len(params), _PARAMS_PER_CALL):
            self._client.log_batch(self._run_id, params=params[first : first + _PARAMS_PER_CALL])

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(key, float(value), now, step) for key, value in scalars.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def rewind(self, step: int) -> None:
        pass  # MLflow keeps every value; see the class

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def open_writer(workdir: str, start_step: int) -> MlflowWriter:
    return MlflowWriter(workdir)


def client():
    """MLflow's client on its tracking URI; a URI it cannot use (the default `sqlite:` without
    the full `mlflow`, a file store MLflow 3.7+ refuses unless asked) is a ConfigError. Builds
    no connection: checked before anything is written."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return mlflow.MlflowClient()
    except MlflowException as e:
        raise _start_error(e) from None


def check_environment() -> None:
    client()


def _start_error(error) -> ConfigError:
    import mlflow

    where = os.environ.get("MLFLOW_TRACKING_URI") or f"{mlflow.get_tracking_uri()} (the default)"
    fix = "set MLFLOW_TRACKING_URI to your tracking server (http://HOST:5000)"
    if "MLFLOW_ALLOW_FILE_STORE" in str(error):
        fix = "set MLFLOW_ALLOW_FILE_STORE=true to log to this file store, or " + fix
    return ConfigError(f"MLflow cannot log to {where}: {first_line(error, 100)}; {fix}")
