"""The `tokenizer` flow: ingest and decontaminate (reused when done) → train or load the tokenizer.

Decontamination (`decontaminate.enabled`) runs between ingestion and the tokenizer; its output
is an ingest-format corpus, and `corpus_path` picks the corpus every later stage reads.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import RunConfig, load_config
from pipelines.ingest_flow import ingest_flow
from pipelines.runtime import resolve_environment
from pipelines.stage_tracking import track_stage_task
from tasks.decontaminate_run import decontaminate_task
from tasks.tokenizer_run import tokenizer_task


def corpus_path(stages: dict[str, dict[str, Any]]) -> str:
    """Return the corpus the stages after ingestion read: decontaminated when that stage ran."""
    return str(stages.get("decontaminate", stages["ingest"])["path"])


@flow(name="tokenizer")
def tokenizer_flow(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Run ingestion, decontamination when enabled, then the tokenizer stage.

    Returns each stage's summary by name; `decontaminate` is there only when it is enabled.
    """
    cfg = resolve_environment(cfg)
    stages = ingest_flow(cfg)
    if cfg.decontaminate.enabled:
        clean = decontaminate_task(cfg.decontaminate, stages["ingest"]["path"], str(cfg.workspace))
        stages |= {"decontaminate": clean | {"mlflow_run_id": track_stage_task(clean, cfg)}}
    result = tokenizer_task(cfg.tokenizer, corpus_path(stages), str(cfg.workspace))
    return stages | {"tokenizer": result | {"mlflow_run_id": track_stage_task(result, cfg)}}


if __name__ == "__main__":
    tokenizer_flow(load_config(sys.argv[1], sys.argv[2:]))
