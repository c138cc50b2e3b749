"""The `ingest` flow: raw corpus files → cleaned, deduplicated, split Arrow shards."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import ConfigError, RunConfig, load_config
from pipelines.runtime import resolve_environment
from pipelines.stage_tracking import track_stage_task
from tasks.ingest_run import ingest_task


@flow(name="ingest")
def ingest_flow(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Ingest the corpus into fingerprinted Arrow shards; returns `{"ingest": summary}`."""
    cfg = resolve_environment(cfg)
    if cfg.ingest is None:
        raise ConfigError("this command needs an `ingest` section (the corpus to read)")
    result = ingest_task(cfg.ingest, cfg.ray, str(cfg.workspace))
    return {"ingest": result | {"mlflow_run_id": track_stage_task(result, cfg)}}


if __name__ == "__main__":
    ingest_flow(load_config(sys.argv[1], sys.argv[2:]))
