"""The `pipeline` flow: every stage, in order (ingest → ... → pretrain → fine-tune → evaluate)."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import RunConfig, load_config
from pipelines.evaluate_flow import evaluate_flow
from pipelines.finetune_flow import finetune_flow
from pipelines.pretrain_flow import pretrain_flow


@flow(name="pipeline")
def pipeline_flow(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Run the whole pipeline on one config; returns each stage's summary by name.

    Each stage flow runs its upstream stages first; a stage whose fingerprint (inputs, config
    section, code) is unchanged reuses its output. Fine-tuning runs when a `task` is set.
    """
    stages = pretrain_flow(cfg)
    # Later flows run their upstream stages again (reused); the first summaries are kept.
    if cfg.task is not None:
        stages = finetune_flow(cfg) | stages
    return evaluate_flow(cfg) | stages


if __name__ == "__main__":
    pipeline_flow(load_config(sys.argv[1], sys.argv[2:]))
