"""The `pretrain` flow: the data stages (reused when done) → DeepSpeed pretraining on Ray Train."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import RunConfig, load_config
from pipelines.examples_flow import examples_flow
from pipelines.runtime import resolve_environment
from training.pretrain import pretrain_task


@flow(name="pretrain")
def pretrain_flow(cfg: RunConfig, resume: bool = False) -> dict[str, dict[str, Any]]:
    """Run ingest → tokenizer → encode → examples, then pretrain, export and register a model.

    A finished run with the same inputs and train config is reused; `resume` continues a run
    that stopped (killed, preempted) from its newest valid checkpoint.
    """
    cfg = resolve_environment(cfg)
    stages = examples_flow(cfg)
    examples, tokenizer = stages["examples"]["path"], stages["tokenizer"]["path"]
    result = pretrain_task(
        cfg.train,
        cfg.seed,
        examples,
        tokenizer,
        str(cfg.workspace),
        cfg.ray,
        cfg.tracking,
        cfg.name,
        resume,
    )
    return stages | {"pretrain": result}


if __name__ == "__main__":
    pretrain_flow(load_config(sys.argv[1], sys.argv[2:]))
