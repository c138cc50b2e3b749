"""The `pretrain` flow: the data stages (reused when done) → DeepSpeed pretraining on Ray Train."""

from __future__ import annotations

import sys

from pipelines.config import RunConfig, load_config
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.steps import Stages, pretrain_step, run_data_steps
from pipelines.ops.runtime import resolve_environment


@recipe_flow(name="pretrain")
def pretrain_flow(cfg: RunConfig, resume: bool = False) -> Stages:
    """Run ingest → tokenizer → encode → examples, then pretrain, export and register a model.

    A finished run with the same inputs and train config is reused; `resume` continues a run
    that stopped (killed, preempted) from its newest valid checkpoint.
    """
    cfg = resolve_environment(cfg)
    # The data stages as tasks of this flow run, as `pipeline_flow` runs them: a nested
    # `examples` flow run would cost its own API round trips and engine start (0.5 s).
    stages = run_data_steps(cfg, "examples")
    return stages | pretrain_step(cfg, stages, resume)


if __name__ == "__main__":
    pretrain_flow(load_config(sys.argv[1], sys.argv[2:]))
