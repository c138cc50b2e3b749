"""The `pipeline` flow: every stage that exists, in order (ingestion so far)."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import RunConfig, load_config
from pipelines.ingest_flow import ingest_flow


@flow(name="pipeline")
def pipeline_flow(cfg: RunConfig) -> dict[str, Any]:
    """Run the whole pipeline on one config: corpus → shards (later stages join as they land)."""
    return {"ingest": ingest_flow(cfg)}


if __name__ == "__main__":
    pipeline_flow(load_config(sys.argv[1], sys.argv[2:]))
