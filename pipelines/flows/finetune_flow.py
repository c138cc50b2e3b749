"""The `finetune` flow: prepare the task, find the base model, fine-tune, register, report."""

from __future__ import annotations

import sys
from typing import Any

from pipelines.config import ConfigError, RunConfig, load_config
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.steps import (
    Stages,
    downstream_step,
    finetune_step,
    pretrain_step,
    run_data_steps,
)
from pipelines.ops.runtime import resolve_environment


def prepare_task(cfg: RunConfig) -> dict[str, Any]:
    """Prepare (or reuse) the configured downstream task under `<workspace>/downstream/`."""
    if cfg.task is None:
        raise ConfigError("this command needs a `task` section (the downstream dataset)")
    return downstream_step(cfg, {})["downstream"]


def upstream(cfg: RunConfig) -> Stages:
    """The stages that give the base model: none with `finetune.base`, else the pretrain flow's.

    As tasks of the calling flow run (docs/pipeline.md, "One flow run per command").
    """
    if cfg.finetune.base is not None:
        return {}
    stages = run_data_steps(cfg, "examples")
    return stages | pretrain_step(cfg, stages)


@recipe_flow(name="finetune")
def finetune_flow(cfg: RunConfig) -> Stages:
    """Fine-tune the base model on the task; returns each stage's summary by name.

    The fine-tuned model is exported, registered with lineage to its base model version, and
    its report is logged to MLflow and published as a Prefect artifact.
    """
    cfg = resolve_environment(cfg)
    stages = {"downstream": prepare_task(cfg)} | upstream(cfg)
    return stages | finetune_step(cfg, stages)


if __name__ == "__main__":
    finetune_flow(load_config(sys.argv[1], sys.argv[2:]))
