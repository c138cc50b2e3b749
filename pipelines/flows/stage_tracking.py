"""MLflow records of a run: a finished data stage, a reused stage, the pipeline's parent run.

Each data stage's run lists the outputs it read as MLflow dataset inputs (`stage_inputs`): the
upstream stages named in its manifest, or, for ingestion and a downstream task, its source
files. Every run here is opened and ended by `training.tracking.runs.tracked_run`.

MLflow holds the runs that did work. A data stage's run is recorded in the workspace
(`<workspace>/mlflow-runs/`, one small JSON file per output, store and experiment); a cache
hit of a stage command names that run (`recorded_run`) and logs no new one, so an all-cache-hit
rerun neither imports MLflow nor calls it. Under the `pipeline` flow's parent run, and when no
run of the output is recorded for this store, a cache hit still logs a complete run, tagged
`lmpipe.reused=true`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext

from pipelines.config import RunConfig
from tasks.common.io import atomic_writer, fingerprint, public_dump
from training.tracking.local_store import local_store_uri
from training.tracking.runs import DatasetRef, MlflowTracker, tracked_run

log = logging.getLogger(__name__)
_MAX_FILE_INPUTS = 64  # corpus files listed one by one; more are grouped by source
#: Where a workspace records the MLflow run of each data stage output (`run_record`).
RUNS_DIR = "mlflow-runs"


@task(name="track-stage", cache_policy=NO_CACHE)
def track_stage_task(result: dict[str, Any], cfg: RunConfig) -> str | None:
    """Log a finished stage to MLflow: params, metrics, manifest, config and its artifacts.

    The params are the stage's config section; the metrics and the files logged as artifacts
    are those the manifest lists (`metrics`, `artifacts`). A reused output (a cache hit) that
    gets here (`recorded_run` names none) gets a complete run too, tagged
    `lmpipe.reused=true`, holding its files and its inputs (`stage_inputs`). The run is
    recorded as the output's (`run_record`) when the stage built the output or none was
    recorded. Nothing in the output directory is rewritten when it is reused, so every file
    keeps its modification time. Returns the MLflow run id (None when tracking is off).
    """
    out = Path(result["path"])
    stage = result["stage"]
    manifest = json.loads((out / "manifest.json").read_text())
    tags = {
        "lmpipe.stage": stage,
        "lmpipe.fingerprint": result["fingerprint"],
        "lmpipe.reused": str(result["reused"]).lower(),
        "lmpipe.git_commit": str(manifest["code"].get("git_commit")),
        **{f"lmpipe.{k}": str(v) for k, v in manifest.get("tags", {}).items()},
    }
    assert cfg.tracking.tracking_uri is not None  # filled by resolve_environment
    name = f"{cfg.name}-{stage}"
    with tracked_run(cfg.tracking, Path(cfg.workspace), name, tags) as tracker:
        config = public_dump(cfg)
        tracker.log_params({stage: config[stage], "name": cfg.name, "seed": cfg.seed})
        tracker.log_metrics(manifest["metrics"])
        tracker.log_inputs(stage_inputs(stage, manifest, Path(cfg.workspace)))
        tracker.log_artifact(out / "manifest.json", "manifest")
        config_file = out / "run_config.yaml"
        if not result["reused"] or not config_file.is_file():
            with atomic_writer(config_file, "w") as handle:
                # libyaml's emitter: the same text as yaml.safe_dump, in a quarter of the time
                handle.write(yaml.dump(config, Dumper=yaml.CSafeDumper, sort_keys=False))
        tracker.log_artifact(config_file, "config")
        for name in manifest.get("artifacts", []):
            tracker.log_artifact(out / name, stage)
        get_run_logger().info("MLflow run %s", tracker.run_id)
    record = run_record(cfg, result)
    if tracker.run_id is not None and (not result["reused"] or _read_run(record, result) is None):
        run = {k: result[k] for k in ("stage", "fingerprint", "path")}
        with atomic_writer(record, "w") as handle:
            json.dump(run | {"run_id": tracker.run_id}, handle)
    return tracker.run_id


def run_record(cfg: RunConfig, result: dict[str, Any]) -> Path:
    """The file that names the MLflow run of a data stage's output, in this store and experiment.

    `<workspace>/mlflow-runs/<stage>-<fingerprint>-<digest>.json`; the digest is over the
    tracking URI, the experiment and the output's path, so another store (the temporary
    SQLite one, a server) or experiment has its own record. The URI itself, which may carry a
    password, is not written. The workspace's own store and an output inside the workspace are
    named without the workspace's place, so a copied or moved workspace, whose store moves
    with it (`training.tracking.local_store`), finds its records.
    """
    workspace = Path(cfg.workspace)
    uri = str(cfg.tracking.tracking_uri)
    store = "<workspace>" if uri == local_store_uri(workspace) else uri
    out = Path(result["path"])
    place = out.relative_to(workspace).as_posix() if out.is_relative_to(workspace) else str(out)
    where = "\n".join([store, cfg.tracking.experiment, place])
    digest = hashlib.sha256(where.encode()).hexdigest()[:12]
    name = f"{result['stage']}-{result['fingerprint']}-{digest}.json"
    return Path(cfg.workspace) / RUNS_DIR / name


def recorded_run(cfg: RunConfig, result: dict[str, Any]) -> str | None:
    """The MLflow run a data stage's cache hit names instead of logging one, if recorded.

    None (log a run: `track_stage_task`) unless the stage reused its output, tracking is on,
    no parent run nests the stage runs (the `pipeline` flow lists every stage under its own),
    and `run_record` names a run of this output's fingerprint.
    """
    if not result["reused"] or not cfg.tracking.enabled or cfg.tracking.parent_run_id:
        return None
    run_id = _read_run(run_record(cfg, result), result)
    if run_id is not None:
        log.info("%s: cache hit; its MLflow run is %s", result["stage"], run_id)
    return run_id


def _read_run(record: Path, result: dict[str, Any]) -> str | None:
    """The run id `record` holds for `result`'s output; None when none is (or it is unreadable)."""
    try:
        run = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    same = isinstance(run, dict) and run.get("fingerprint") == result["fingerprint"]
    return str(run["run_id"]) if same and run.get("run_id") else None


@task(name="record-stage", cache_policy=NO_CACHE)
def record_stage_task(
    cfg: RunConfig,
    stage: str,
    result: dict[str, Any],
    params: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
) -> str | None:
    """Record a stage that keeps no MLflow run of its own, or a reused one, as an MLflow run.

    Used for the downstream preparation and for cache hits of training and evaluation. The
    run is tagged with the stage, `lmpipe.reused` and the fingerprint; a reused stage points at
    the run that built its output (`lmpipe.source_run`) and names its registered model. The
    downstream run lists its source files as dataset inputs. Returns the new run's id (None
    when tracking is off).
    """
    tags = {"lmpipe.stage": stage, "lmpipe.reused": str(bool(result.get("reused"))).lower()}
    if result.get("fingerprint"):
        tags["lmpipe.fingerprint"] = str(result["fingerprint"])
    if result.get("reused"):
        tags["lmpipe.source_run"] = str(result.get("mlflow_run_id"))
    if result.get("model_name"):
        tags["lmpipe.model"] = f"{result['model_name']}/{result.get('model_version')}"
    assert cfg.tracking.tracking_uri is not None  # filled by resolve_environment
    name = f"{cfg.name}-{stage}"
    with tracked_run(cfg.tracking, Path(cfg.workspace), name, tags) as tracker:
        if stage == "downstream" and cfg.task is not None:
            manifest = json.loads((Path(result["path"]) / "manifest.json").read_text())
            where = Path(cfg.workspace), Path(cfg.task.base_dir)
            tracker.log_inputs(stage_inputs(stage, manifest, *where))
        if params:
            tracker.log_params(params)
        if metrics is None:
            tests = {f"test_{k}": v for k, v in (result.get("test") or {}).items()}
            metrics = {k: float(v) for k, v in ((result.get("metrics") or {}) | tests).items()}
        tracker.log_metrics(metrics)
        return tracker.run_id


@contextmanager
def pipeline_run(cfg: RunConfig) -> Iterator[RunConfig]:
    """Open the pipeline's parent MLflow run; yield the config that nests stage runs under it.

    The run is named `<name>-pipeline`, holds the whole config as params, and ends FINISHED,
    FAILED when a stage raises, or KILLED on an interrupt (`tracked_run`). With tracking off,
    the config is yielded unchanged.
    """
    context = FlowRunContext.get()
    flow_run = str(context.flow_run.id) if context and context.flow_run else "none"
    tags = {"lmpipe.stage": "pipeline", "lmpipe.prefect_flow_run": flow_run}
    name = f"{cfg.name}-pipeline"
    with tracked_run(cfg.tracking, Path(cfg.workspace), name, tags) as tracker:
        if tracker.run_id is None:  # tracking off
            yield cfg
            return
        tracker.log_params(public_dump(cfg))
        tracking = cfg.tracking.model_copy(update={"parent_run_id": tracker.run_id})
        yield cfg.model_copy(update={"tracking": tracking})


def record_pipeline(cfg: RunConfig, stages: dict[str, dict[str, Any]], markdown: str) -> None:
    """Log the pipeline's outcome to its parent run: cache hits, models, the summary."""
    uri, run_id = cfg.tracking.tracking_uri, cfg.tracking.parent_run_id
    if not cfg.tracking.enabled or uri is None or run_id is None:
        return
    tracker = MlflowTracker(uri, run_id)
    reused = [name for name, s in stages.items() if s.get("reused")]
    tracker.log_metrics({"stages": len(stages), "stages_reused": len(reused)})
    tags = {"lmpipe.stages_reused": ",".join(reused) or "-"}
    for name, summary in stages.items():
        if summary.get("mlflow_run_id"):
            tags[f"lmpipe.run.{name}"] = str(summary["mlflow_run_id"])
        if summary.get("model_name"):
            tags[f"lmpipe.model.{name}"] = f"{summary['model_name']}/{summary['model_version']}"
    tracker.set_tags(tags)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline_summary.md"
        path.write_text(markdown, encoding="utf-8")
        tracker.log_artifact(path, "summary")


def stage_inputs(
    stage: str, manifest: dict[str, Any], workspace: Path, base_dir: Path | None = None
) -> list[DatasetRef]:
    """What a data stage read, from its manifest: one dataset input per upstream output.

    Tokenizer, encode and examples name each upstream output (`{"fingerprint", "path"}`) in
    their manifest; decontamination names the ingest output it filtered (by fingerprint, in
    the workspace); ingestion its corpus files (`corpus_inputs`), a downstream task and a
    tokenizer loaded from your files their source files (sha256). A downstream task records
    its sources relative to the task's `base_dir`, which makes them absolute here.
    """
    refs = [
        DatasetRef(key, str(value["fingerprint"]), str(value["path"]))
        for key, value in manifest.items()
        if isinstance(value, dict) and {"fingerprint", "path"} <= value.keys()
    ]
    inputs = manifest.get("inputs")
    if stage == "decontaminate" and "decontaminated_from" in manifest:
        ingest = str(manifest["decontaminated_from"])
        refs.append(DatasetRef("ingest", ingest, str(workspace / "ingest" / ingest)))
    elif stage == "ingest" and isinstance(inputs, list):
        refs += corpus_inputs(inputs)
    elif stage == "downstream" and isinstance(inputs, dict):
        root = base_dir or Path()
        refs += [DatasetRef("source", str(sha), str(root / path)) for path, sha in inputs.items()]
    elif stage == "tokenizer" and isinstance(inputs, dict) and "files" in inputs:
        files = inputs["files"].values()
        refs += [DatasetRef("tokenizer_file", str(f["sha256"]), str(f["path"])) for f in files]
    return refs


def corpus_inputs(files: list[dict[str, Any]]) -> list[DatasetRef]:
    """The corpus files an ingestion read: one input per file (its xxh3-128 and URI).

    Past `_MAX_FILE_INPUTS` files, one input per configured source instead, its digest a hash
    of its files' digests, so that a corpus of many files stays a readable list in the UI.
    """
    if len(files) <= _MAX_FILE_INPUTS:
        return [DatasetRef("corpus", str(f["xxh3_128"]), str(f["uri"])) for f in files]
    sources: dict[str, list[str]] = {}
    for f in files:
        sources.setdefault(str(f["source"]), []).append(str(f["xxh3_128"]))
    return [
        DatasetRef("corpus", fingerprint(sorted(digests), length=32), source)
        for source, digests in sorted(sources.items())
    ]
