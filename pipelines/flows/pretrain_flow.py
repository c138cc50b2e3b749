"""The `pretrain` flow: the data stages (reused when done) → DeepSpeed pretraining on Ray Train."""

from __future__ import annotations

import sys

from pipelines.config import RunConfig, load_config
from pipelines.flows.examples_flow import examples_flow
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.steps import Stages, pretrain_step
from pipelines.ops.runtime import resolve_environment


@recipe_flow(name="pretrain")
def pretrain_flow(cfg: RunConfig, resume: bool = False) -> Stages:
    """Run ingest → tokenizer → encode → examples, then pretrain, export and register a model.

    A finished run with the same inputs and train config is reused; `resume` continues a run
    that stopped (killed, preempted) from its newest valid checkpoint.
    """
    cfg = resolve_environment(cfg)
    stages = examples_flow(cfg)
    return stages | pretrain_step(cfg, stages, resume)


if __name__ == "__main__":
    pretrain_flow(load_config(sys.argv[1], sys.argv[2:]))
