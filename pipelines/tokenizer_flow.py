"""The `tokenizer` flow: ingest (reused when done) → train or load the tokenizer."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import RunConfig, load_config
from pipelines.ingest_flow import ingest_flow
from pipelines.runtime import resolve_environment
from pipelines.stage_tracking import track_stage_task
from tasks.tokenizer_run import tokenizer_task


@flow(name="tokenizer")
def tokenizer_flow(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Run ingestion, then the tokenizer stage; returns each stage's summary by name."""
    cfg = resolve_environment(cfg)
    stages = ingest_flow(cfg)
    result = tokenizer_task(cfg.tokenizer, stages["ingest"]["path"], str(cfg.workspace))
    return stages | {"tokenizer": result | {"mlflow_run_id": track_stage_task(result, cfg)}}


if __name__ == "__main__":
    tokenizer_flow(load_config(sys.argv[1], sys.argv[2:]))
