"""The Prefect task that records one finished stage in MLflow: params, metrics, manifest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipelines.config import RunConfig
from tasks.io import atomic_writer, public_dump
from training.tracking import flatten, stage_run


def stage_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """Turn a manifest's counts, sizes and timing into flat numeric metrics."""
    counts = manifest["counts"]
    metrics: dict[str, float] = {
        k: float(v) for k, v in flatten(counts).items() if isinstance(v, int | float)
    }
    metrics["filtered_total"] = float(sum(counts["filtered"].values()))
    metrics["duplicates_total"] = float(sum(counts["duplicates"].values()))
    metrics["quarantined_total"] = float(sum(counts["quarantined"].values()))
    shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    metrics["shards"] = float(len(shards))
    metrics["output_bytes"] = float(sum(s["bytes"] for s in shards))
    metrics["input_bytes"] = float(sum(i["size"] for i in manifest["inputs"]))
    if manifest.get("elapsed_s"):
        metrics["elapsed_s"] = float(manifest["elapsed_s"])
        metrics["throughput_mb_s"] = metrics["input_bytes"] / 2**20 / manifest["elapsed_s"]
    return metrics


@task(name="track-stage", cache_policy=NO_CACHE)
def track_stage_task(result: dict[str, Any], cfg: RunConfig) -> str | None:
    """Log a finished stage to MLflow: the config as params, counts as metrics, the manifest.

    Returns the MLflow run id (None when tracking is off).
    """
    out = Path(result["path"])
    manifest = json.loads((out / "manifest.json").read_text())
    tags = {
        "lmpipe.stage": result["stage"],
        "lmpipe.fingerprint": result["fingerprint"],
        "lmpipe.reused": str(result["reused"]).lower(),
        "lmpipe.git_commit": str(manifest["code"].get("git_commit")),
    }
    assert cfg.tracking.tracking_uri is not None  # filled by resolve_environment
    with stage_run(
        cfg.tracking,
        cfg.tracking.tracking_uri,
        Path(cfg.workspace),
        f"{cfg.name}-{result['stage']}",
        tags,
    ) as tracker:
        config = public_dump(cfg)
        tracker.log_params(
            {result["stage"]: config[result["stage"]], "name": cfg.name, "seed": cfg.seed}
        )
        tracker.log_metrics(stage_metrics(manifest))
        tracker.log_artifact(out / "manifest.json", "manifest")
        config_file = out / "run_config.yaml"
        with atomic_writer(config_file, "w") as handle:
            handle.write(yaml.safe_dump(config, sort_keys=False))
        tracker.log_artifact(config_file, "config")
        get_run_logger().info("MLflow run %s", tracker.run_id)
        return tracker.run_id
