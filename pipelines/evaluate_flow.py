"""The `evaluate` flow: intrinsic evaluation of the base model, and prompting on the task."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from pipelines.config import RunConfig, load_config
from pipelines.finetune_flow import base_model, prepare_task
from pipelines.runtime import resolve_environment
from training.evaluate import evaluate_task


@flow(name="evaluate")
def evaluate_flow(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Probe the base model and, with `evaluate.prompting`, classify the task by prompting.

    Held-out metrics when lmpipe pretrained the model; fill-mask probes (encoders) or
    generation samples (decoders, T5); one MLflow run and one Prefect artifact.
    """
    cfg = resolve_environment(cfg)
    model_dir, _, stages = base_model(cfg)
    data = prepare_task(cfg) if cfg.task is not None else None
    examples = None
    if "examples" in stages:
        examples = (stages["examples"]["path"], stages["tokenizer"]["path"])
    out = cfg.workspace / "evaluate" / cfg.name
    result = evaluate_task(
        model_dir,
        cfg.evaluate,
        str(out),
        cfg.tracking,
        str(cfg.workspace),
        cfg.name,
        cfg.seed,
        examples,
        data["path"] if data else None,
    )
    return stages | {"evaluate": result | {"report_dir": str(out)}}


if __name__ == "__main__":
    evaluate_flow(load_config(sys.argv[1], sys.argv[2:]))
