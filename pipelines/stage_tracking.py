"""The Prefect task that records one finished stage in MLflow: params, metrics, artifacts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipelines.config import RunConfig
from tasks.io import atomic_writer, public_dump
from training.tracking import stage_run


@task(name="track-stage", cache_policy=NO_CACHE)
def track_stage_task(result: dict[str, Any], cfg: RunConfig) -> str | None:
    """Log a finished stage to MLflow: params, metrics, manifest, config and its artifacts.

    The params are the stage's config section; the metrics and the files logged as artifacts
    are those the manifest lists (`metrics`, `artifacts`). Returns the MLflow run id (None
    when tracking is off).
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
    with stage_run(
        cfg.tracking, cfg.tracking.tracking_uri, Path(cfg.workspace), f"{cfg.name}-{stage}", tags
    ) as tracker:
        config = public_dump(cfg)
        tracker.log_params({stage: config[stage], "name": cfg.name, "seed": cfg.seed})
        tracker.log_metrics(manifest["metrics"])
        tracker.log_artifact(out / "manifest.json", "manifest")
        for name in manifest.get("artifacts", []):
            tracker.log_artifact(out / name, stage)
        config_file = out / "run_config.yaml"
        with atomic_writer(config_file, "w") as handle:
            handle.write(yaml.safe_dump(config, sort_keys=False))
        tracker.log_artifact(config_file, "config")
        get_run_logger().info("MLflow run %s", tracker.run_id)
        return tracker.run_id
