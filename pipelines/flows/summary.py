"""What each stage produced, in words: rows for the CLI table and Markdown for Prefect.

`stage_rows` turns one stage's summary into (what, value) rows (counts, metrics, status, output,
MLflow run, registered model); `publish_stage` publishes them as the stage's Prefect Markdown
artifact with links to its MLflow run and registered model; `where_to_look` closes a command
with the registered models and how to open the UIs.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext, TaskRunContext

from pipelines.config import RunConfig
from pipelines.ops.prefect_api import temporary_api_urls
from tasks.common.io import redact_url

Rows = list[tuple[str, str]]
_BIN = Path(sys.executable).parent  # the venv's scripts (mlflow, prefect), activated or not


def stage_rows(name: str, result: dict[str, Any]) -> Rows:
    """The rows that describe one stage's summary (from the summary and its manifest).

    The table says what this run did: a stage built now shows its own `elapsed s`; a reused
    one shows "reused (cache hit)" and no time (the manifest's is the original build's).
    """
    if name in _ROWS:
        rows = _ROWS[name](result)
    else:
        manifest = json.loads((Path(result["path"]) / "manifest.json").read_text())
        if name in ("ingest", "decontaminate"):  # a decontaminated corpus is ingest-format
            rows = _decontaminate_rows(manifest) if name == "decontaminate" else []
            rows += _ingest_rows(manifest)
            if "elapsed_s" in manifest:
                rows.insert(0, ("elapsed s", f"{manifest['elapsed_s']:,.4g}"))
        else:
            rows = _metric_rows(manifest["metrics"])
        rows += [("output", result["path"]), ("MLflow run", str(result.get("mlflow_run_id")))]
    if result.get("reused"):
        rows = [row for row in rows if row[0] not in _BUILD_TIMES]
    if "reused" in result:
        rows.append(("status", "reused (cache hit)" if result["reused"] else "built"))
    return rows


#: Rows that time a stage's build: a cache hit's would be the original build's, not this run's.
_BUILD_TIMES = frozenset({"elapsed s"})


def publish_stage(cfg: RunConfig, stage: str, result: dict[str, Any]) -> None:
    """Publish a stage's summary as a Prefect Markdown artifact (inside a flow run only).

    The artifact (key `<name>-<stage>`) holds the stage's rows, a link to its MLflow run and,
    when the stage registered a model, to the model version in the registry.
    """
    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    lines = [f"# {stage}: {cfg.name}", "", "| what | value |", "|---|---|"]
    lines += [f"| {_cell(what)} | {_cell(value)} |" for what, value in stage_rows(stage, result)]
    lines += ["", *_links(cfg, result)]
    create_markdown_artifact(
        "\n".join(lines) + "\n",
        key=artifact_key(f"{cfg.name}-{stage}"),
        description=f"lmpipe {stage} summary",
    )


def artifact_key(name: str) -> str:
    """A Prefect artifact key from a name: lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")[:60] or "stage"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _links(cfg: RunConfig, result: dict[str, Any]) -> list[str]:
    """Markdown links to the stage's MLflow run and registered model (or where to find them)."""
    run_id, model = result.get("mlflow_run_id"), result.get("model_name")
    version = result.get("model_version")
    base = _public(cfg.tracking.ui_base())
    lines: list[str] = []
    if base is None:
        store = _public(cfg.tracking.tracking_uri)
        if run_id:
            lines.append(f"MLflow run `{run_id}` in `{store}` (open it with `mlflow ui`).")
        if model:
            lines.append(f"Registered model `{model}` version {version}.")
        return lines
    if run_id:
        lines.append(f"[MLflow run {run_id}]({base}/#/runs/{run_id})")
    if model:
        lines.append(
            f"[Registered model {model} v{version}]({base}/#/models/{model}/versions/{version})"
        )
    return lines


def where_to_look(cfg: RunConfig, stages: dict[str, dict[str, Any]]) -> list[str]:
    """Closing lines: each registered model, and how to open the MLflow and Prefect UIs."""
    lines = []
    for name, result in stages.items():
        if result.get("model_name"):
            alias = f", URI {result['model_uri']}" if result.get("model_uri") else ""
            lines.append(
                f"registered model ({name}): {result['model_name']} "
                f"version {result.get('model_version')}{alias}"
            )
    base = _public(cfg.tracking.ui_base())
    store = _public(cfg.tracking.tracking_uri)
    if base is not None:
        lines.append(f"MLflow UI:  {base}")
    elif store is not None and cfg.tracking.enabled:
        lines.append(
            f"MLflow UI:  mlflow ui --backend-store-uri {store}  (then http://127.0.0.1:5000)"
        )
    api = _public(os.environ.get("PREFECT_API_URL"))
    if api and api not in temporary_api_urls():  # a temporary API is gone when we exit
        lines.append(f"Prefect UI: {api.removesuffix('/').removesuffix('/api')}")
    else:
        home = os.environ.get("PREFECT_HOME", "~/.prefect")
        lines.append(
            f"Prefect UI: PREFECT_HOME={home} {_BIN / 'prefect'} server start"
            "  (then open http://127.0.0.1:4200)"
        )
    return lines


def _public(url: str | None) -> str | None:
    """`url` without the password a tracking URI from the environment may carry."""
    return None if url is None else redact_url(url)


def _pretrain_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("step", str(result["step"])), ("finished", str(result["finished"]))]
    rows += _metric_rows(result.get("metrics", {}))
    keys = ("checkpoint", "export_dir", "model_name", "model_version", "mlflow_run_id")
    return rows + _keys(result, *keys)


def _keys(result: dict[str, Any], *keys: str) -> list[tuple[str, str]]:
    return [(k.replace("_", " "), str(result[k])) for k in keys if k in result]


def _downstream_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("task", f"{result['name']} ({result['task_type']})")]
    rows += [(f"split {s}", f"{e['rows']:,} examples") for s, e in result["splits"].items()]
    return [*rows, ("output", str(result["path"])), *_keys(result, "mlflow_run_id")]


def _finetune_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("strategy", str(result["strategy"])),
        ("epochs run / best", f"{result['epochs_run']} / {result['best_epoch'] + 1}"),
        ("trainable parameters", f"{result['trainable_parameters']:,}"),
    ]
    rows += _metric_rows({f"test {k}": v for k, v in result["test"].items()})
    return rows + _keys(result, "export_dir", "model_name", "model_version", "mlflow_run_id")


def _compare_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        (str(r["strategy"]), f"{r['mean']:.4f} ± {r['std']:.4f} ({len(r['values'])} seeds)")
        for r in result["rows"]
    ]
    return [*rows, ("report", str(result["report_dir"]))]


def _evaluate_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = _metric_rows({f"held-out {k}": v for k, v in result.get("heldout", {}).items()})
    if "prompting" in result:
        prompted = result["prompting"]["metrics"]
        rows += _metric_rows({f"prompting {k}": v for k, v in prompted.items()})
    tuned = result.get("finetuned", {}).get("test", {})
    rows += _metric_rows({f"fine-tuned test {k}": v for k, v in tuned.items()})
    return [*rows, ("report", str(result["report_dir"])), *_keys(result, "mlflow_run_id")]


_ROWS: dict[str, Callable[[dict[str, Any]], list[tuple[str, str]]]] = {
    "pretrain": _pretrain_rows,
    "downstream": _downstream_rows,
    "finetune": _finetune_rows,
    "compare": _compare_rows,
    "evaluate": _evaluate_rows,
}


def _metric_rows(metrics: dict[str, float]) -> list[tuple[str, str]]:
    return [
        (key.replace("_", " "), f"{value:,}" if isinstance(value, int) else f"{value:,.4g}")
        for key, value in metrics.items()
    ]


def _decontaminate_rows(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    report = manifest["decontamination"]
    rows = [("n-gram words", str(report["n"]))]
    rows += [(f"removed by {name}", f"{n:,}") for name, n in report["removed_by"].items()]
    return [*rows, ("documents removed", f"{report['documents_removed']:,}")]


def _ingest_rows(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    counts = manifest["counts"]
    rows = [("documents read", f"{counts['read']:,}"), ("kept", f"{counts['kept']:,}")]
    for group in ("filtered", "duplicates", "quarantined"):
        rows += [(f"{group}: {reason}", f"{n:,}") for reason, n in counts[group].items()]
    for split in ("train", "validation", "test"):
        entry = manifest["splits"][split]
        size = sum(s["bytes"] for s in entry["shards"]) / 2**20
        rows.append(
            (
                f"split {split}",
                f"{entry['rows']:,} docs, {len(entry['shards'])} shards, {size:.1f} MiB",
            )
        )
    return rows


def pipeline_markdown(cfg: RunConfig, stages: dict[str, dict[str, Any]]) -> str:
    """The whole run in Markdown: one table per stage, then models and where to look."""
    parts = [f"# Pipeline {cfg.name}", ""]
    for name, result in stages.items():
        parts += [f"## {name}", "", "| what | value |", "|---|---|"]
        parts += [f"| {_cell(what)} | {_cell(value)} |" for what, value in stage_rows(name, result)]
        parts += ["", *_links(cfg, result), ""]
    parts += [f"- {line}" for line in where_to_look(cfg, stages)]
    return "\n".join(parts) + "\n"


def publish_pipeline(cfg: RunConfig, stages: dict[str, dict[str, Any]]) -> str:
    """Publish the pipeline's summary as a Prefect Markdown artifact; return the Markdown."""
    text = pipeline_markdown(cfg, stages)
    if FlowRunContext.get() is not None:
        key = artifact_key(f"{cfg.name}-pipeline")
        create_markdown_artifact(text, key=key, description="lmpipe pipeline summary")
    return text
