"""The fine-tuning stage: one Ray Train run per (task data, base model, config, seed), in MLflow.

`run_finetune` trains on Ray (`training/finetune/loop.py`) into `<root>/<key>/` (a run as a
stage output, `training/runtime/driver.py`), where the key hashes the prepared task data, the
base model's files, the config, the seed and the code, so the same inputs reuse a finished run.
`finetune_stage` adds tracking: params, per-epoch metrics (`train_loss`, `val_<metric>`), test
metrics (`test_<metric>`), the report artifact, and registration of the export with lineage to
its base.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks.common.caching import stage_task
from tasks.common.io import fingerprint, flatten, sha256_file
from tasks.common.stage import StageOutput, complete_manifest
from training.finetune.config import FinetuneConfig
from training.finetune.evaluation import METRIC_PREFIX
from training.finetune.loop import FINETUNE_LOOP, FinetuneJob
from training.finetune.outputs import RESULT_FILE
from training.models.config import BaseModelRef
from training.models.export import export_layout
from training.runtime.driver import EXPORT_DIR, RunDirectory, RunIdentity, upstream_ref
from training.runtime.launcher import describe_scale, resolve_scale, scale_params
from training.runtime.progress import ProgressSpec, artifact_key
from training.runtime.run_context import RunContext
from training.tracking.model_ref import resolve_base_model
from training.tracking.registry import Registration, register_export
from training.tracking.runs import (
    DatasetRef,
    MlflowTracker,
    TrackingConfig,
    output_ref,
    tracked_run,
)

log = logging.getLogger(__name__)

STAGE = "finetune"


@dataclass(frozen=True)
class FinetuneRun:
    """A finished fine-tuning run: its directory and result."""

    run_dir: Path
    result: dict[str, Any]

    @property
    def export_dir(self) -> Path:
        """The fine-tuned model in Hugging Face format."""
        return self.run_dir / EXPORT_DIR


def model_fingerprint(model_dir: Path) -> str:
    """A hash of a model directory's config and weight files (what fine-tuning starts from).

    Remembered in this process while the files keep their sizes and modification times: a
    call is planned twice (its Prefect cache key, then the run), and a base model's weights
    take seconds to hash.
    """
    files = sorted(
        p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file()
    )
    stats = tuple((p.resolve(), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _files_fingerprint(stats)


@lru_cache(maxsize=64)
def _files_fingerprint(stats: tuple[tuple[Path, int, int], ...]) -> str:
    return fingerprint({path.name: sha256_file(path) for path, _, _ in stats})


def finetune_identity(
    cfg: FinetuneConfig, seed: int, data_dir: Path, model_dir: Path
) -> RunIdentity:
    """What keys a fine-tuning run: task data and base model fingerprints, config, seed, code."""
    data = json.loads((data_dir / "manifest.json").read_text())["fingerprint"]
    model = model_fingerprint(model_dir)
    # Where the one worker runs (Ray Train or this process) does not change what is trained.
    train = cfg.model_dump(
        mode="json",
        exclude={
            "register_model": True,
            "model_name": True,
            "alias": True,
            "base": True,
            "scale": {"launcher"},
        },
    )
    upstream = {
        "downstream": upstream_ref(data, data_dir),
        "base_model": upstream_ref(model, model_dir),
    }
    return RunIdentity(STAGE, {"data": data, "model": model}, train, seed, upstream)


def finetune_run_id(cfg: FinetuneConfig, seed: int, data_dir: Path, model_dir: Path) -> str:
    """The run's key (its directory's name): `finetune_identity`'s."""
    return finetune_identity(cfg, seed, data_dir, model_dir).key


def run_finetune(
    cfg: FinetuneConfig,
    data_dir: Path,
    model_dir: Path,
    root: Path,
    *,
    run: RunContext,
    mlflow_run_id: str | None = None,
    progress: ProgressSpec | None = None,
) -> FinetuneRun:
    """Fine-tune where `finetune.scale.launcher` says (or find the finished run of this key).

    The run goes to `<root>/<key>/` (`finetune_identity`); `run` gives the seed, Ray and the
    tracking URI the worker logs to. `progress`: how this process shows the run's progress
    (None: not at all).
    """
    run_dir = finetune_identity(cfg, run.seed, data_dir, model_dir).place(root, run.workspace)
    return train(run_dir, cfg, run=run, mlflow_run_id=mlflow_run_id, progress=progress)


def train(
    run_dir: RunDirectory,
    cfg: FinetuneConfig,
    *,
    run: RunContext,
    mlflow_run_id: str | None = None,
    progress: ProgressSpec | None = None,
) -> FinetuneRun:
    """Fine-tune the planned run, or find it finished (its `result.json` written).

    An unfinished attempt is removed first: fine-tuning restarts from its base model.
    """
    result_file = run_dir.path / RESULT_FILE
    if result_file.is_file():
        log.info("fine-tuning run %s already finished: reused", run_dir.key)
        return FinetuneRun(run_dir.path, json.loads(result_file.read_text()))
    run_dir.open(keep=False, mlflow_run_id=mlflow_run_id)
    upstream = run_dir.upstream
    job = FinetuneJob(
        finetune=cfg,
        seed=run.seed,
        data_dir=Path(upstream["downstream"]["path"]),
        model_dir=Path(upstream["base_model"]["path"]),
        config_hash=run_dir.key,
        tracking_uri=run.tracking_uri,
        mlflow_run_id=mlflow_run_id,
    )
    run_dir.fit(FINETUNE_LOOP, job, cfg.scale, run.ray, progress)
    if not result_file.is_file():
        raise RuntimeError(f"{run_dir.path}: fine-tuning ended without {RESULT_FILE}")
    return FinetuneRun(run_dir.path, json.loads(result_file.read_text()))


def finetune_stage(
    cfg: FinetuneConfig,
    data_dir: Path,
    model_dir: Path,
    *,
    run: RunContext,
    lineage: dict[str, str],
    progress: ProgressSpec | None = None,
) -> dict[str, Any]:
    """Fine-tune, log to MLflow (params, epochs, test metrics, report), register the export.

    Args:
        cfg: The `finetune` section.
        data_dir: A prepared downstream task (`tasks/downstream/downstream.py`).
        model_dir: The base model, a Hugging Face directory.
        run: The run context: its workspace holds `finetune/<key>/`; its seed seeds the new
            head, the data order and dropout; its name prefixes the MLflow run's and the
            registered model's names.
        lineage: Tags that trace the base model (e.g. `base_model_name`, `base_model_version`).
        progress: How this process shows the run's progress (None: not at all).

    Returns:
        A summary: run directory, result (metrics, best epoch, trainable parameters, time),
        export directory, MLflow run id and registered version (when registered).
    """
    identity = finetune_identity(cfg, run.seed, data_dir, model_dir)
    run_dir = identity.place(run.workspace / STAGE, run.workspace)
    done = run_dir.reuse()
    if done is not None:
        return done | {"reused": True}
    scale = resolve_scale(cfg.scale, run.ray)
    precision, scale_text = cfg.precision_choice(), describe_scale(scale)
    log.info("fine-tuning run %s: %s, %s", run_dir.key, precision, scale_text)
    uri = run.tracking_uri
    task = json.loads((data_dir / "manifest.json").read_text())
    tags = {"stage": STAGE, "finetune_run": run_dir.key, "task_type": task["task_type"]}
    name, workspace = f"{run.name}-finetune", run.workspace
    with tracked_run(run.tracking, workspace, name, tags | lineage, system_metrics=True) as tracker:
        mlflow_run = tracker.run_id
        tracker.log_params(
            flatten({"finetune": cfg.model_dump(mode="json"), "seed": run.seed})
            | {"resolved_precision": cfg.precision, "requested_precision": cfg.requested_precision}
            | scale_params(scale)
        )
        model = DatasetRef("base_model", identity.inputs["model"], str(model_dir), "training")
        tracker.log_inputs([output_ref("downstream", data_dir, "training"), model])
        resolved = cfg.model_copy(update={"scale": scale})
        done_run = train(run_dir, resolved, run=run, mlflow_run_id=mlflow_run, progress=progress)
        summary = {"run_dir": str(done_run.run_dir), "export_dir": str(done_run.export_dir)}
        summary |= done_run.result | {"mlflow_run_id": mlflow_run}
        if uri is not None and mlflow_run is not None:
            summary |= _publish(done_run, cfg, uri, mlflow_run, run.name, task, lineage)
    run_dir.commit(summary)
    return summary | {"reused": False}


def _publish(
    run: FinetuneRun,
    cfg: FinetuneConfig,
    uri: str,
    mlflow_run: str,
    run_name: str,
    task: dict[str, Any],
    lineage: dict[str, str],
) -> dict[str, Any]:
    from training.scoring.report import finetune_report

    tracker = MlflowTracker(uri, mlflow_run)
    test = {f"{METRIC_PREFIX['test']}{k}": float(v) for k, v in run.result["test"].items()}
    tracker.log_metrics(test | {"best_epoch": float(run.result["best_epoch"])})
    for path in finetune_report(run.run_dir, run.result, task):
        tracker.log_artifact(path, "report")
    if not cfg.register_model:
        return {}
    family = json.loads((run.export_dir / "config.json").read_text())["model_type"]
    name = cfg.model_name or f"{run_name}-{task.get('name', task['task_type'])}"
    tags = lineage | {"finetune_run": run.run_dir.name, "task_type": task["task_type"]}
    registration = Registration(name, cfg.alias, tags)
    task_type, code_model = task["task_type"], None
    if export_layout(run.export_dir) == "adapters":  # MLflow's own loaders cannot serve it
        from training.finetune.serving import adapters_code_model  # imports MLflow: seconds

        code_model = adapters_code_model(run.export_dir, task_type)
    ref = register_export(
        run.export_dir, family, uri, mlflow_run, registration, task_type, code_model
    )
    return {"model_name": ref.name, "model_version": ref.version, "model_uri": ref.model_uri}


def plan_finetune_task(
    cfg: FinetuneConfig, data_dir: str, model_dir: str, run: RunContext
) -> StageOutput:
    """The run a `finetune_task` call reuses, for the task's Prefect cache (`StageCache`)."""
    identity = finetune_identity(cfg, run.seed, Path(data_dir), Path(model_dir))
    return identity.place(run.workspace / STAGE, run.workspace).out


@stage_task(STAGE, plan_finetune_task, complete_manifest)
def finetune_task(
    cfg: FinetuneConfig,
    data_dir: str,
    model_dir: str,
    *,
    run: RunContext,
    lineage: dict[str, str],
) -> dict[str, Any]:
    """Prefect task: `finetune_stage` on paths; publishes the report as a Markdown artifact.

    The run's progress is a live line on a terminal, else a log line per epoch, and a Prefect
    progress artifact; its title names the strategy and seed (a comparison runs several).
    Cached in Prefect on the run's key while the run's manifest is complete, as the data
    stages are (`tasks.common.caching`).
    """
    logger = get_run_logger()
    logger.info("fine-tuning: %s", cfg.precision_choice())  # shown on the console
    key = artifact_key(f"{run.name}-finetune-progress")
    progress = ProgressSpec(progress_title(cfg, run.seed), logger, key)
    summary = finetune_stage(
        cfg, Path(data_dir), Path(model_dir), run=run, lineage=lineage, progress=progress
    )
    report = Path(summary["run_dir"]) / "report" / "report.md"
    if report.is_file():
        create_markdown_artifact(
            report.read_text(), key=artifact_key(f"{run.name}-finetune"), description="Fine-tuning"
        )
    return summary


def progress_title(cfg: FinetuneConfig, seed: int) -> str:
    """The progress line's title: the strategy, the initialisation when random, the seed."""
    init = ", random init" if cfg.random_init else ""
    return f"finetune {cfg.strategy.name}{init} seed {seed}"


@task(name="resolve-base-model", cache_policy=NO_CACHE)
def resolve_base_model_task(
    ref: BaseModelRef, tracking: TrackingConfig, workspace: str
) -> tuple[str, dict[str, str]]:
    """Prefect task: `resolve_base_model` (download a registry version when needed)."""
    uri = tracking.tracking_uri if tracking.enabled else None
    path, lineage = resolve_base_model(ref, uri, Path(workspace))
    return str(path), lineage
