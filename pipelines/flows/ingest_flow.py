"""The `ingest` flow: raw corpus files → cleaned, deduplicated, split Arrow shards."""

from __future__ import annotations

import sys

from pipelines.config import RunConfig, load_config
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.steps import Stages, run_data_steps
from pipelines.ops.runtime import resolve_environment


@recipe_flow(name="ingest")
def ingest_flow(cfg: RunConfig) -> Stages:
    """Ingest the corpus into fingerprinted Arrow shards; returns `{"ingest": summary}`."""
    cfg = resolve_environment(cfg)
    return run_data_steps(cfg, "ingest")


if __name__ == "__main__":
    ingest_flow(load_config(sys.argv[1], sys.argv[2:]))
