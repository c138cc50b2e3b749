"""The `encode` flow: ingest, decontaminate and tokenizer (reused when done) → token shards.

Every stage is a task of this one flow run (`run_data_steps`).
"""

from __future__ import annotations

import sys

from pipelines.config import RunConfig, load_config
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.steps import Stages, run_data_steps
from pipelines.ops.runtime import resolve_environment


@recipe_flow(name="encode")
def encode_flow(cfg: RunConfig) -> Stages:
    """Run the stages up to the tokenizer, then encode the corpus; returns each stage's summary.

    The corpus is the one the tokenizer trained on (decontaminated when that is enabled).
    """
    cfg = resolve_environment(cfg)
    return run_data_steps(cfg, "encode")


if __name__ == "__main__":
    encode_flow(load_config(sys.argv[1], sys.argv[2:]))
