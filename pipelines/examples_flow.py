"""The `examples` flow: ingest, tokenizer and encode (reused when done) → pretraining examples."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import RunConfig, load_config
from pipelines.encode_flow import encode_flow
from pipelines.runtime import resolve_environment
from pipelines.stage_tracking import track_stage_task
from tasks.examples_run import examples_task


@flow(name="examples")
def examples_flow(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Run the upstream stages, then cut the examples; returns each stage's summary."""
    cfg = resolve_environment(cfg)
    stages = encode_flow(cfg)
    encode, tokenizer = stages["encode"]["path"], stages["tokenizer"]["path"]
    result = examples_task(cfg.examples, cfg.seed, cfg.ray, encode, tokenizer, str(cfg.workspace))
    return stages | {"examples": result | {"mlflow_run_id": track_stage_task(result, cfg)}}


if __name__ == "__main__":
    examples_flow(load_config(sys.argv[1], sys.argv[2:]))
