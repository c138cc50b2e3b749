"""The `encode` flow: ingest, decontaminate and tokenizer (reused when done) → token shards."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import RunConfig, load_config
from pipelines.runtime import resolve_environment
from pipelines.stage_tracking import track_stage_task
from pipelines.tokenizer_flow import corpus_path, tokenizer_flow
from tasks.encode_run import encode_task


@flow(name="encode")
def encode_flow(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Run the stages up to the tokenizer, then encode the corpus; returns each stage's summary.

    The corpus is the one the tokenizer trained on (decontaminated when that is enabled).
    """
    cfg = resolve_environment(cfg)
    stages = tokenizer_flow(cfg)
    corpus, tokenizer = corpus_path(stages), stages["tokenizer"]["path"]
    result = encode_task(cfg.encode, cfg.ray, corpus, tokenizer, str(cfg.workspace))
    return stages | {"encode": result | {"mlflow_run_id": track_stage_task(result, cfg)}}


if __name__ == "__main__":
    encode_flow(load_config(sys.argv[1], sys.argv[2:]))
