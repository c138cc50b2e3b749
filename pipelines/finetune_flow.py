"""The `finetune` flow: prepare the task, find the base model, fine-tune, register, report."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import ConfigError, RunConfig, load_config
from pipelines.pretrain_flow import pretrain_flow
from pipelines.runtime import resolve_environment
from tasks.downstream_stage import prepare_downstream_task
from training.finetune import finetune_task, resolve_base_model_task


def prepare_task(cfg: RunConfig) -> dict[str, Any]:
    """Prepare (or reuse) the configured downstream task under `<workspace>/downstream/`."""
    if cfg.task is None:
        raise ConfigError("this command needs a `task` section (the downstream dataset)")
    dataset = cfg.task.resolved()
    out = cfg.workspace / "downstream" / dataset.name
    return prepare_downstream_task(dataset, str(cfg.task.base_dir), str(out)).model_dump()


def base_model(cfg: RunConfig) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The model to fine-tune, its lineage tags, and the upstream stages run to get it.

    Without `finetune.base`, it is the model the pretrain flow exports (reused when done).
    """
    if cfg.finetune.base is not None:
        path, lineage = resolve_base_model_task(cfg.finetune.base, cfg.tracking, str(cfg.workspace))
        return path, lineage, {}
    stages = pretrain_flow(cfg)
    pre = stages["pretrain"]
    lineage = {
        "base_model_name": str(pre.get("model_name")),
        "base_model_version": str(pre.get("model_version")),
        "base_model_path": str(pre["export_dir"]),
    }
    return str(pre["export_dir"]), lineage, stages


@flow(name="finetune")
def finetune_flow(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Fine-tune the base model on the task; returns each stage's summary by name.

    The fine-tuned model is exported, registered with lineage to its base model version, and
    its report is logged to MLflow and published as a Prefect artifact.
    """
    cfg = resolve_environment(cfg)
    data = prepare_task(cfg)
    model_dir, lineage, stages = base_model(cfg)
    result = finetune_task(
        cfg.finetune,
        cfg.seed,
        data["path"],
        model_dir,
        str(cfg.workspace),
        cfg.ray,
        cfg.tracking,
        cfg.name,
        lineage,
    )
    return stages | {"downstream": data, "finetune": result}


if __name__ == "__main__":
    finetune_flow(load_config(sys.argv[1], sys.argv[2:]))
