"""The `pipeline` flow: every stage once, in order, under one MLflow parent run.

ingest → decontaminate (when enabled) → tokenizer → encode → examples → pretrain (export,
register) → downstream task → fine-tune (when a `task` is set) → evaluate. Each stage is a
Prefect task that passes manifests and paths on, never tables; a stage whose inputs, config
section and code are unchanged reports a cache hit and rewrites nothing.
"""

from __future__ import annotations

import sys

from pipelines.config import ConfigError, RunConfig, load_config
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.stage_tracking import pipeline_run, record_pipeline
from pipelines.flows.steps import (
    Stages,
    downstream_step,
    evaluate_step,
    finetune_step,
    pretrain_step,
    run_data_steps,
)
from pipelines.flows.summary import publish_pipeline
from pipelines.ops.runtime import resolve_environment


@recipe_flow(name="pipeline")
def pipeline_flow(cfg: RunConfig = RunConfig()) -> Stages:  # noqa: B008 (the UI form's defaults)
    """Run the whole pipeline on one config; returns each stage's summary by name.

    Without an `ingest` section the data and pretraining stages are skipped and the model to
    fine-tune and evaluate is `finetune.base`. Stage runs in MLflow are nested under one
    `<name>-pipeline` run, and each stage publishes a Markdown summary as a Prefect artifact.
    """
    cfg = resolve_environment(cfg)
    if cfg.ingest is None and cfg.finetune.base is None:
        raise ConfigError("the pipeline needs an `ingest` section or a `finetune.base` model")
    with pipeline_run(cfg) as cfg:
        stages: Stages = {}
        if cfg.ingest is not None:
            stages |= run_data_steps(cfg, "examples")
            stages |= pretrain_step(cfg, stages)
        if cfg.task is not None:
            stages |= downstream_step(cfg, stages)
            stages |= finetune_step(cfg, stages)
        stages |= evaluate_step(cfg, stages)
        record_pipeline(cfg, stages, publish_pipeline(cfg, stages))
    return stages


if __name__ == "__main__":
    pipeline_flow(load_config(sys.argv[1], sys.argv[2:]))
