"""The `tokenizer` flow: ingest and decontaminate (reused when done) → train or load the tokenizer.

Decontamination (`decontaminate.enabled`) runs between ingestion and the tokenizer; its output
is an ingest-format corpus, and `corpus_path` picks the corpus every later stage reads. Every
stage is a task of this one flow run (`run_data_steps`).
"""

from __future__ import annotations

import sys

from pipelines.config import RunConfig, load_config
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.steps import Stages, corpus_path, run_data_steps
from pipelines.ops.runtime import resolve_environment

__all__ = ["corpus_path", "tokenizer_flow"]


@recipe_flow(name="tokenizer")
def tokenizer_flow(cfg: RunConfig) -> Stages:
    """Run ingestion, decontamination when enabled, then the tokenizer stage.

    Returns each stage's summary by name; `decontaminate` is there only when it is enabled.
    """
    cfg = resolve_environment(cfg)
    return run_data_steps(cfg, "tokenizer")


if __name__ == "__main__":
    tokenizer_flow(load_config(sys.argv[1], sys.argv[2:]))
