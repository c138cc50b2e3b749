"""Experiment tracking: the `Tracker` protocol, its MLflow and null implementations, run lifecycle.

Only rank 0 (or a stage's driver) logs. Every MLflow run lmpipe makes is opened, resumed and
ended by `tracked_run` (FINISHED, FAILED on an exception, KILLED on an interrupt), which also
samples system metrics for training runs. A run's inputs are `DatasetRef`s, logged as MLflow
dataset inputs, so the UI traces a model version to the data it came from. Nothing here reads
environment variables: the entry points in `pipelines/` resolve the tracking URI and
credentials and pass them in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from tasks.common.io import flatten

log = logging.getLogger(__name__)
_PARAM_MAX = 6000  # MLflow's limit on one param value
_DIGEST_MAX = 36  # MLflow's limit on a dataset digest (mlflow.utils.validation)


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
    system_metrics_interval_s: float = Field(
        2.0,
        ge=0,
        description="Seconds between system-metric samples (CPU, memory, GPU) of a training "
        "run; 0 turns them off. Short, so that a run of a minute still gets a curve.",
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
    def log_inputs(self, inputs: Sequence[DatasetRef]) -> None: ...  # noqa: D102


class NullTracker:
    """A tracker that records nothing (tracking disabled, or a rank other than 0)."""

    run_id: str | None = None
    end_status = "FINISHED"

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Do nothing."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Do nothing."""

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Do nothing."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Do nothing."""

    def log_inputs(self, inputs: Sequence[DatasetRef]) -> None:
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
        #: The status `tracked_run` ends the run with when its body returns.
        self.end_status = "FINISHED"

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

    def log_inputs(self, inputs: Sequence[DatasetRef]) -> None:
        """Log what the run read as MLflow dataset inputs (name, digest, source, context)."""
        datasets = [_dataset_input(ref) for ref in inputs]
        for start in range(0, len(datasets), 100):
            self.client.log_inputs(self.run_id, datasets=datasets[start : start + 100])


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:_PARAM_MAX]


@dataclass(frozen=True)
class DatasetRef:
    """One input a run read, as MLflow's dataset input: what, which version, where, how.

    Attributes:
        name: What it is, usually the upstream stage (`examples`, `tokenizer`, `downstream`).
        digest: Its fingerprint (at most 36 characters, MLflow's limit).
        source: Where it is: the output directory, a manifest or a corpus file.
        context: How the run used it (`mlflow.data.context`): `training`, `input`, `evaluation`.
    """

    name: str
    digest: str
    source: str
    context: str = "input"


def output_ref(name: str, out_dir: Path | str, context: str = "input") -> DatasetRef:
    """A stage output as a run input: its manifest's fingerprint, else the manifest's sha256.

    Raises:
        FileNotFoundError: `out_dir` holds no `manifest.json`.
    """
    manifest_path = Path(out_dir) / "manifest.json"
    blob = manifest_path.read_bytes()
    digest = json.loads(blob).get("fingerprint") or hashlib.sha256(blob).hexdigest()
    return DatasetRef(name, str(digest), str(out_dir), context)


def _dataset_input(ref: DatasetRef) -> Any:
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    scheme = urlsplit(ref.source).scheme
    # A one-letter scheme is a Windows drive; MLflow's local sources have type "local".
    source_type = scheme if len(scheme) > 1 and scheme != "file" else "local"
    dataset = Dataset(
        name=ref.name,
        digest=ref.digest[:_DIGEST_MAX],
        source_type=source_type,
        source=json.dumps({"uri": ref.source}),
    )
    return DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, ref.context)])


@contextmanager
def tracked_run(
    cfg: TrackingConfig,
    workspace: Path,
    run_name: str,
    tags: Mapping[str, str],
    *,
    run_id: str | None = None,
    system_metrics: bool = False,
) -> Iterator[MlflowTracker | NullTracker]:
    """Open (or, with `run_id`, resume) an MLflow run; end it when the body ends.

    The one lifecycle of every run lmpipe makes (pipeline, data stages, training, comparison,
    evaluation). The run ends `tracker.end_status` (FINISHED unless the body sets KILLED, as
    a pretraining run stopped early does); KILLED on a KeyboardInterrupt, FAILED on any other
    exception, which is re-raised. With tracking off (or no URI) the body gets a NullTracker.
    `system_metrics` samples this machine's CPU, memory, disk, network (and NVIDIA GPUs when
    `pynvml` loads) into the run every `cfg.system_metrics_interval_s` while the body runs.
    With a local SQLite store, the experiment's artifacts go to `<workspace>/mlartifacts`
    (the workspace's own store is re-rooted when the workspace moves,
    `training.tracking.local_store`).
    """
    uri = cfg.tracking_uri
    if not cfg.enabled or not uri:
        yield NullTracker()
        return
    from mlflow.tracking import MlflowClient

    resumed = run_id is not None
    run_id = _open_run(cfg, uri, workspace, run_name, tags, run_id)
    tracker = MlflowTracker(uri, run_id)
    monitor = _system_monitor(cfg, uri, run_id, resumed) if system_metrics else None
    status = "FAILED"
    try:
        yield tracker
        status = tracker.end_status
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if monitor is not None:
            _finish_monitor(monitor, run_id)
        MlflowClient(uri).set_terminated(run_id, status)


def _finish_monitor(monitor: Any, run_id: str) -> None:
    """Stop `monitor` and log the sample it took last, before the run ends.

    MLflow's monitor takes a sample, waits an interval, then logs it; stopped during the wait,
    it drops that sample. So a run shorter than one interval got no system metrics at all, and
    every run lost its last moments.
    """
    monitor.finish()
    try:
        last = monitor.aggregate_metrics()
        if last:
            monitor.publish_metrics(last)
            monitor.mlflow_logger.flush()
    except Exception:  # a metric lost costs the curve its last point, never the run
        log.warning("the last system-metric sample of run %s was not logged", run_id, exc_info=True)


def _open_run(
    cfg: TrackingConfig,
    tracking_uri: str,
    workspace: Path,
    run_name: str,
    tags: Mapping[str, str],
    run_id: str | None,
) -> str:
    """Create a RUNNING run in the configured experiment, or reopen `run_id`; return its id."""
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


def _system_monitor(cfg: TrackingConfig, uri: str, run_id: str, resumed: bool) -> Any:
    """A started MLflow system-metrics monitor on `run_id`, or None when it cannot run."""
    if cfg.system_metrics_interval_s <= 0:
        return None
    try:  # needs psutil; a missing or broken one costs the metrics, never the run
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            run_id,
            sampling_interval=cfg.system_metrics_interval_s,
            resume_logging=resumed,  # a resumed run's samples continue its steps
            tracking_uri=uri,
        )
        monitor.start()
    except Exception:
        log.warning("system metrics are off for run %s", run_id, exc_info=True)
        return None
    return monitor


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
