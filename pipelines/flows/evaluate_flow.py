"""The `evaluate` flow: intrinsic evaluation of the base model, and prompting on the task."""

from __future__ import annotations

import sys

from pipelines.config import RunConfig, load_config
from pipelines.flows.finetune_flow import prepare_task, upstream
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.steps import Stages, evaluate_step
from pipelines.ops.runtime import resolve_environment


@recipe_flow(name="evaluate")
def evaluate_flow(cfg: RunConfig) -> Stages:
    """Probe the base model and, with `evaluate.prompting`, classify the task by prompting.

    Held-out metrics when lmpipe pretrained the model; fill-mask probes (encoders) or
    generation samples (decoders, T5); one MLflow run and one Prefect artifact.
    """
    cfg = resolve_environment(cfg)
    stages = upstream(cfg)
    if cfg.task is not None:
        stages["downstream"] = prepare_task(cfg)
    return stages | evaluate_step(cfg, stages)


if __name__ == "__main__":
    evaluate_flow(load_config(sys.argv[1], sys.argv[2:]))
