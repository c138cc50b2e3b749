"""The `compare` flow: several strategies x seeds on one task, one table, one MLflow experiment."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from pipelines.config import RunConfig, load_config
from pipelines.flows.finetune_flow import prepare_task, upstream
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.steps import base_model, run_context
from pipelines.ops.runtime import resolve_environment
from tasks.common.caching import in_workspace, stage_summary
from training.finetune.compare import compare_task
from training.finetune.stage import finetune_task


@recipe_flow(name="compare")
def compare_flow(cfg: RunConfig) -> dict[str, Any]:
    """Fine-tune each `compare.entries` strategy once per seed and compare them.

    Every run goes to the experiment `compare.experiment` (default `<experiment>-compare`),
    with a summary run holding the table (mean and spread over seeds, trainable parameters,
    time) and its bar chart; the table is also a Prefect artifact.
    """
    cfg = resolve_environment(cfg)
    experiment = cfg.compare.experiment or f"{cfg.tracking.experiment}-compare"
    tracking = cfg.tracking.model_copy(update={"experiment": experiment})
    run = replace(run_context(cfg), tracking=tracking)
    data = prepare_task(cfg)
    model_dir, lineage = base_model(cfg, upstream(cfg))
    names, summaries = [], []
    task = in_workspace(finetune_task, cfg.workspace)
    for entry in cfg.compare.entries:
        update = {
            "strategy": entry.strategy,
            "random_init": entry.random_init,
            "register_model": False,
        }
        finetune = cfg.finetune.model_copy(update=update)
        for seed in cfg.compare.seeds:
            seeded = replace(run, seed=seed)
            args = (finetune, data["path"], model_dir)
            state = task(*args, run=seeded, lineage=lineage, return_state=True)
            summaries.append(stage_summary(state, cfg.workspace))
            names.append(entry.name())
    out = cfg.workspace / "compare" / data["fingerprint"]
    table = (names, summaries, cfg.compare.metric, str(out), data["path"])
    rows = compare_task(*table, run=run)
    return {"downstream": data, "compare": {"rows": rows, "report_dir": str(out)}}


if __name__ == "__main__":
    compare_flow(load_config(sys.argv[1], sys.argv[2:]))
