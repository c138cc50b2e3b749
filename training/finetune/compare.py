"""Strategy comparison: several strategies (and seeds) on one task, one table, one experiment.

`CompareConfig` lists the entries to compare (a strategy, optionally from random weights);
each entry is fine-tuned once per seed by the flow (`pipelines/flows/compare_flow.py`), every run in
the same MLflow experiment. `summarise_comparison` turns their summaries into one row per entry
(mean and standard deviation over seeds of the test metric, trainable parameters, time) and
`log_comparison` writes the table, the bar chart and per-entry metrics into a summary run.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from training.finetune.config import CompareConfig as CompareConfig
from training.finetune.config import CompareEntry as CompareEntry
from training.runtime.run_context import RunContext
from training.scoring.report import comparison_report
from training.tracking.runs import output_ref, tracked_run


def summarise_comparison(
    names: Sequence[str], summaries: Sequence[Mapping[str, Any]], metric: str | None
) -> tuple[list[dict[str, Any]], str]:
    """One row per entry name from run summaries (`names[i]` is `summaries[i]`'s entry).

    Returns:
        The rows (strategy, values per seed, mean, std, trainable parameters, mean time) in
        first-seen order, and the metric compared.

    Raises:
        ValueError: a run lacks the metric on its test (or, without test, validation) split.
    """
    if len(names) != len(summaries):
        raise ValueError(f"{len(names)} names for {len(summaries)} summaries")
    metric = metric or str(summaries[0]["metric"])
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for name, summary in zip(names, summaries, strict=True):
        grouped.setdefault(name, []).append(summary)
    rows = []
    for name, runs in grouped.items():
        values = [_held_out(run, metric) for run in runs]
        rows.append(
            {
                "strategy": name,
                "values": values,
                "mean": statistics.fmean(values),
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "trainable_parameters": int(runs[0]["trainable_parameters"]),
                "train_time_s": statistics.fmean(float(r["train_time_s"]) for r in runs),
            }
        )
    return rows, metric


def _held_out(summary: Mapping[str, Any], metric: str) -> float:
    scores = summary["test"] or summary["validation"]
    if metric not in scores:
        raise ValueError(f"run {summary.get('run_dir')} has no {metric!r}: {sorted(scores)}")
    return float(scores[metric])


def log_comparison(
    rows: Sequence[Mapping[str, Any]],
    metric: str,
    out_dir: Path,
    *,
    run: RunContext,
    data_dir: Path | None = None,
) -> str:
    """Write the comparison report; log it with per-row metrics to a summary MLflow run.

    The run is `<run.name>-compare`, in `run.tracking`'s experiment. `data_dir`, the prepared
    task the runs were fine-tuned and tested on, is the run's dataset input. The run ends FAILED
    when logging raises. Returns the Markdown table.
    """
    files, text = comparison_report(rows, metric, out_dir, f"Strategy comparison ({metric})")
    name = f"{run.name}-compare"
    with tracked_run(run.tracking, run.workspace, name, {"stage": "compare"}) as tracker:
        if data_dir is not None:
            tracker.log_inputs([output_ref("downstream", data_dir, "evaluation")])
        tracker.log_params({"metric": metric, "rows": ",".join(str(r["strategy"]) for r in rows)})
        for row in rows:
            key = "".join(c if c.isalnum() else "_" for c in str(row["strategy"]))
            tracker.log_metrics(
                {
                    f"{key}_{metric}_mean": float(row["mean"]),
                    f"{key}_{metric}_std": float(row["std"]),
                    f"{key}_trainable_parameters": float(row["trainable_parameters"]),
                    f"{key}_train_time_s": float(row["train_time_s"]),
                }
            )
        for path in files:
            tracker.log_artifact(path, "comparison")
    return text


@task(name="compare", cache_policy=NO_CACHE)
def compare_task(
    names: list[str],
    summaries: list[dict[str, Any]],
    metric: str | None,
    out_dir: str,
    data_dir: str | None = None,
    *,
    run: RunContext,
) -> list[dict[str, Any]]:
    """Prefect task: summarise, log and publish the comparison (a Markdown artifact)."""
    rows, chosen = summarise_comparison(names, summaries, metric)
    data = Path(data_dir) if data_dir else None
    text = log_comparison(rows, chosen, Path(out_dir), run=run, data_dir=data)
    create_markdown_artifact(text, key="strategy-comparison", description="Strategy comparison")
    return rows
