"""Experiment tracking: the `Tracker` protocol, its MLflow and null implementations.

Only rank 0 (or a stage's driver) logs. Nothing here reads environment variables: the entry
points in `pipelines/` resolve the tracking URI and credentials and pass them in.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from tasks.common.io import flatten

log = logging.getLogger(__name__)
_PARAM_MAX = 6000  # MLflow's limit on one param value


class TrackingConfig(BaseModel):
    """Where runs, metrics and artifacts go."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    enabled: bool = Field(True, description="Log stages and training to MLflow.")
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default: a SQLite file in the workspace."
    )
    experiment: str = Field("lmpipe", min_length=1, description="MLflow experiment name.")
    username: str | None = Field(None, description="Basic-auth user of a tracking server.")
    password: SecretStr | None = Field(None, description="Basic-auth password (never logged).")
    ui_url: str | None = Field(
        None,
        description="MLflow UI address for links in summaries; default: the tracking URI when "
        "it is http(s), else none (open `mlflow ui` on the store).",
    )
    parent_run_id: str | None = Field(
        None,
        description="Nest every stage's run under this MLflow run (the pipeline flow sets it "
        "to its own parent run).",
    )

    def ui_base(self) -> str | None:
        """The MLflow UI address that links point at, or None when there is no server."""
        if self.ui_url:
            return self.ui_url.rstrip("/")
        uri = self.tracking_uri or ""
        return uri.rstrip("/") if uri.startswith(("http://", "https://")) else None


class Tracker(Protocol):
    """What stages and the training loop need from a tracker."""

    def log_params(self, params: Mapping[str, Any]) -> None: ...  # noqa: D102
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...  # noqa: D102
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...  # noqa: D102
    def set_tags(self, tags: Mapping[str, str]) -> None: ...  # noqa: D102


class NullTracker:
    """A tracker that records nothing (tracking disabled, or a rank other than 0)."""

    run_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Do nothing."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Do nothing."""

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Do nothing."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Do nothing."""


class MlflowTracker:
    """Log into one MLflow run through `MlflowClient` (safe from any thread or process)."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        """Attach to an existing run `run_id` at `tracking_uri`."""
        # mlflow is imported lazily, here and below: its import took 1.2-1.7 s here, and a
        # run with tracking off (NullTracker) should not pay for it.
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log flattened params (dotted keys); long values are truncated to MLflow's limit."""
        from mlflow.entities import Param

        flat = [Param(k, _param_value(v)) for k, v in sorted(flatten(params).items())]
        for start in range(0, len(flat), 100):
            self.client.log_batch(self.run_id, params=flat[start : start + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log numeric metrics at `step` (0 when None)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, step or 0) for k, v in sorted(metrics.items())]
        for start in range(0, len(rows), 500):
            self.client.log_batch(self.run_id, metrics=rows[start : start + 500])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload a file or directory to the run's artifacts."""
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags."""
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:_PARAM_MAX]


def local_tracking_uri(workspace: Path) -> str:
    """Return the default tracking URI: a SQLite file inside the workspace."""
    return f"sqlite:///{(workspace / 'mlflow.db').resolve()}"


@contextmanager
def stage_run(
    cfg: TrackingConfig, tracking_uri: str, workspace: Path, run_name: str, tags: Mapping[str, str]
) -> Iterator[MlflowTracker | NullTracker]:
    """Open an MLflow run for one stage; end it FINISHED, or FAILED if the body raises.

    With a local SQLite store, the experiment's artifacts go to `<workspace>/mlartifacts`.
    """
    if not cfg.enabled:
        yield NullTracker()
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run_id = open_run(cfg, tracking_uri, workspace, run_name, tags)
    tracker = MlflowTracker(tracking_uri, run_id)
    try:
        yield tracker
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")


def open_run(
    cfg: TrackingConfig,
    tracking_uri: str,
    workspace: Path,
    run_name: str,
    tags: Mapping[str, str],
    run_id: str | None = None,
) -> str:
    """Create a RUNNING run in the configured experiment, or reopen `run_id`; return its id.

    With a local SQLite store, the experiment's artifacts go to `<workspace>/mlartifacts`.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
        return run_id
    if cfg.parent_run_id is not None:
        tags = {**tags, "mlflow.parentRunId": cfg.parent_run_id}
    experiment = experiment_id(cfg, tracking_uri, workspace)
    run = client.create_run(experiment, run_name=run_name, tags=dict(tags))
    return str(run.info.run_id)


def experiment_id(cfg: TrackingConfig, tracking_uri: str, workspace: Path) -> str:
    """The id of the configured experiment, created (with local artifacts) when missing."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(cfg.experiment)
    if experiment is not None:
        return str(experiment.experiment_id)
    location = None
    if tracking_uri.startswith("sqlite:") or tracking_uri.startswith("file:"):
        location = (workspace / "mlartifacts").resolve().as_uri()
    return str(client.create_experiment(cfg.experiment, artifact_location=location))


def set_run_status(tracking_uri: str, run_id: str, status: str) -> None:
    """End a run as FINISHED, FAILED or KILLED."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).set_terminated(run_id, status)
