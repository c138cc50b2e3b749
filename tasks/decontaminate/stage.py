"""The decontamination stage: an ingest output minus the documents that overlap eval sets.

Layout of one output, `<workspace>/decontaminate/<fingerprint>/`: the ingest output's shards,
same names, with every document that shares an `n`-gram with a configured eval set removed (a
shard without such a document is hard-linked, not rewritten), `removed.arrow` (the removed
documents, with `contaminated_by` and `split`), `quarantine.jsonl` (linked from the ingest
output) and `manifest.json`, written last. The directory is built under a temp name and renamed
when complete; a complete output with the same fingerprint (ingest output, config, eval files,
code) is reused as it is, and what interrupted work left inside it is swept.

The manifest is an ingest manifest (`"stage": "ingest"`), so the tokenizer and encode stages
read this output through `read_upstream(path, "ingest")` exactly as they read an ingest output.
Its `counts` still reconcile: each removed document moves from `kept` to
`filtered.contaminated`. It adds `decontamination` (the `DecontaminationReport`),
`decontamination_config`, `decontamination_inputs`, `decontaminated_from` (the ingest
fingerprint) and `removed`. It leaves out the ingest's `dedup_index` and `incremental_key`:
they serve incremental ingests, which only ever extend outputs under `<workspace>/ingest/`.

The n-gram matching itself lives in `tasks/decontaminate/decontaminate.py`.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prefect import get_run_logger

from tasks.common import schema
from tasks.common.caching import refresh_requested, stage_task
from tasks.common.io import public_dump, read_ipc_stream, safe_join
from tasks.common.stage import (
    StageInputError,
    StageOutput,
    StageResult,
    file_entry,
    files_complete,
    plan_output,
    read_upstream,
    shards_of,
)
from tasks.decontaminate.decontaminate import (
    CONTAMINATED_BY,
    DecontaminateConfig,
    DecontaminationReport,
    decontaminate,
    decontamination_report,
    load_eval_ngrams,
)
from tasks.downstream.config import load_dataset_config
from tasks.downstream.stage import input_hashes
from tasks.ingest.output import ingest_metrics, link_file

STAGE = "decontaminate"
UPSTREAM = "ingest"
#: The reason, under `counts.filtered`, that the removed documents are counted as.
CONTAMINATED = "contaminated"
REMOVED_FILE = "removed.arrow"
#: Column of `removed.arrow`: the split of the ingest output the document was removed from.
SPLIT = "split"
REMOVED = schema.DOCUMENTS.append(pa.field(CONTAMINATED_BY, pa.list_(pa.string()))).append(
    pa.field(SPLIT, pa.string())
)
#: Characters MLflow refuses in a metric name (eval set names become part of metric names).
_NOT_METRIC = re.compile(r"[^\w./\- :]")


@dataclass(frozen=True)
class FilteredShards:
    """What filtering every shard produced: new split entries, removals and the report."""

    splits: dict[str, Any]
    removed_per_split: dict[str, int]
    removed_per_source: Counter[str]
    report: DecontaminationReport


def eval_inputs(cfg: DecontaminateConfig) -> list[dict[str, Any]]:
    """Describe what the eval n-grams come from: each task's dataset config and file sha256s."""
    described = []
    for ref in cfg.tasks:
        dataset = load_dataset_config(ref.config)
        described.append(
            {"dataset": public_dump(dataset), "files": input_hashes(dataset, ref.base_dir)}
        )
    return described


def plan_decontaminate(
    cfg: DecontaminateConfig, ingest_dir: Path | str, workspace: Path | str
) -> StageOutput | None:
    """Plan the decontaminated output: fingerprint (ingest, eval files, config, code), place.

    None with `cfg.enabled` False: the stage then makes no output of its own.

    Raises:
        StageInputError: the ingest output is unfinished or lacks a file it lists.
        ValueError: enabled without tasks.
    """
    ingest = read_upstream(ingest_dir, UPSTREAM)
    if not cfg.enabled:
        return None
    if not cfg.tasks:
        raise ValueError("decontaminate.enabled is true but decontaminate.tasks lists no task")
    _check_upstream(Path(ingest_dir), ingest)
    inputs = {"ingest": ingest["fingerprint"], "eval_tasks": eval_inputs(cfg)}
    # The tasks by content (`eval_inputs`), not by where their YAML and files lie: a copied or
    # moved workspace and data keep the fingerprint. The manifest shows the config as given.
    config = public_dump(cfg)
    placed = ("config", "base_dir")
    tasks = [{k: v for k, v in t.items() if k not in placed} for t in config["tasks"]]
    out = plan_output(STAGE, inputs, {**config, "tasks": tasks}, workspace=Path(workspace))
    return replace(out, config=config)


def run_decontaminate(
    cfg: DecontaminateConfig, ingest_dir: Path, workspace: Path, rebuild: bool = False
) -> StageResult:
    """Remove the documents of an ingest output that share an n-gram with the eval sets.

    With `cfg.enabled` False the ingest output itself is returned (same path, reused), so
    that nothing downstream changes. Every split is decontaminated: contamination of held-out
    pretraining data inflates its numbers too. With `rebuild` a complete output is made again
    and replaced whole.

    Raises:
        StageInputError: the ingest output is unfinished or lacks a file it lists.
        ValueError: enabled without tasks, or no task has any of `cfg.eval_splits`.
    """
    started = time.monotonic()
    ingest = read_upstream(ingest_dir, UPSTREAM)
    out = plan_decontaminate(cfg, ingest_dir, workspace)
    if out is None:
        return StageResult(ingest_dir, ingest, reused=True)
    inputs = out.inputs
    done = out.reuse(complete_output, rebuild)
    if done is not None:
        return StageResult(out.path, done, reused=True)
    ngrams = _load_ngrams(cfg)
    tmp = out.open_temp_dir()
    filtered = filter_shards(ingest_dir, ingest, tmp, ngrams, cfg.n)
    manifest = {
        **{k: v for k, v in ingest.items() if k not in ("dedup_index", "incremental_key")},
        "fingerprint": out.fingerprint,
        "code": out.code,
        "decontaminated_from": ingest["fingerprint"],
        "decontamination": filtered.report.model_dump(),
        "decontamination_config": out.config,
        "decontamination_inputs": inputs,
        **_outputs(ingest_dir, ingest, tmp, filtered),
    }
    manifest["metrics"] = ingest_metrics(manifest) | decontamination_metrics(
        filtered.report, time.monotonic() - started
    )
    return out.commit(manifest, built_in=tmp)


def _check_upstream(ingest_dir: Path, ingest: dict[str, Any]) -> None:
    for _, shard in shards_of(ingest):
        if not files_complete(ingest_dir, [shard]):
            raise StageInputError(
                f"{ingest_dir}: ingest shard {shard['name']} is missing or has another size "
                f"than its manifest says ({shard['bytes']} bytes)"
            )


def _load_ngrams(cfg: DecontaminateConfig) -> dict[str, np.ndarray]:
    ngrams = load_eval_ngrams(cfg)
    if not ngrams:
        names = [str(ref.config) for ref in cfg.tasks]
        raise ValueError(
            f"decontaminate: none of the tasks {names} has a split in "
            f"decontaminate.eval_splits {cfg.eval_splits}: there is nothing to check against"
        )
    return ngrams


def complete_output(out: Path) -> dict[str, Any] | None:
    """Return the manifest of a complete decontaminated output at `out`, else None."""
    path = out / "manifest.json"
    if not path.is_file():
        return None
    manifest = read_upstream(out, UPSTREAM)
    listed = [s for _, s in shards_of(manifest)] + [manifest["removed"]]
    if "quarantine" in manifest:
        listed.append(manifest["quarantine"])
    return manifest if files_complete(out, listed) else None


def filter_shards(
    ingest_dir: Path,
    ingest: dict[str, Any],
    out: Path,
    ngrams: dict[str, np.ndarray],
    n: int,
) -> FilteredShards:
    """Decontaminate each shard of every split into `out` and stream removals to REMOVED_FILE.

    Shards keep their names; one from which nothing is removed is hard-linked unchanged.
    """
    empty = schema.DOCUMENTS.empty_table()
    report = decontamination_report(empty, REMOVED.empty_table(), ngrams, n)
    splits: dict[str, Any] = {}
    per_split: dict[str, int] = {}
    per_source: Counter[str] = Counter()
    with open(out / REMOVED_FILE, "wb") as handle, pa.ipc.new_stream(handle, REMOVED) as writer:
        for split, entry in ingest["splits"].items():
            splits[split] = {**entry, "rows": 0, "shards": []}
            per_split[split] = 0
            for shard in entry["shards"]:
                new, kept, removed = _filter_shard(ingest_dir, shard, out, ngrams, n, split)
                writer.write_table(removed)
                report = report.merged(decontamination_report(kept, removed, ngrams, n))
                splits[split]["shards"].append(new)
                splits[split]["rows"] += new["rows"]
                per_split[split] += removed.num_rows
                per_source.update(_count_values(removed.column(schema.SOURCE)))
    return FilteredShards(splits, per_split, per_source, report)


def _filter_shard(
    ingest_dir: Path,
    shard: dict[str, Any],
    out: Path,
    ngrams: dict[str, np.ndarray],
    n: int,
    split: str,
) -> tuple[dict[str, Any], pa.Table, pa.Table]:
    """Return the new shard entry, the kept documents and the removed ones with their split."""
    source = safe_join(ingest_dir, shard["name"], what="ingest shard")
    target = safe_join(out, shard["name"], what="shard")
    kept, removed = decontaminate(read_ipc_stream(source), ngrams, n)
    if removed.num_rows == 0:
        link_file(source, target)  # same bytes: the upstream entry stays right
        entry = dict(shard)
    else:
        _write_stream(kept, target)
        entry = {**shard, "rows": kept.num_rows, **file_entry(out, target)}
    removed = removed.append_column(SPLIT, pa.array([split] * removed.num_rows, pa.string()))
    return entry, kept, removed.cast(REMOVED)


def _write_stream(table: pa.Table, path: Path) -> None:
    # Inside the temp directory, which is itself committed atomically: no temp file needed.
    with open(path, "wb") as handle, pa.ipc.new_stream(handle, table.schema) as writer:
        writer.write_table(table)


def _count_values(values: pa.ChunkedArray) -> Counter[str]:
    counts = pc.value_counts(values.combine_chunks()).to_pylist() if len(values) else []
    return Counter({c["values"]: c["counts"] for c in counts})


def _outputs(
    ingest_dir: Path, ingest: dict[str, Any], out: Path, filtered: FilteredShards
) -> dict[str, Any]:
    """The manifest entries of the written files and the counts that change with them."""
    entries: dict[str, Any] = {
        "splits": filtered.splits,
        "counts": decontaminated_counts(ingest["counts"], filtered.report.documents_removed),
        "removed": {
            **file_entry(out, out / REMOVED_FILE),
            "rows": filtered.report.documents_removed,
            "splits": filtered.removed_per_split,
        },
    }
    if "sources" in ingest:
        entries["sources"] = {
            name: {**entry, "documents": entry["documents"] - filtered.removed_per_source[name]}
            for name, entry in ingest["sources"].items()
        }
    if "quarantine" in ingest:  # linked, so that every file the manifest names is here
        name = ingest["quarantine"]["name"]
        link_file(safe_join(ingest_dir, name, what="quarantine"), safe_join(out, name))
        entries["quarantine"] = ingest["quarantine"]
    return entries


def decontaminated_counts(counts: dict[str, Any], removed: int) -> dict[str, Any]:
    """Move `removed` documents from `kept` to `filtered.contaminated`; check they reconcile.

    Raises:
        AssertionError: the counts do not add up (a bug of a stage, not a data problem).
    """
    filtered = dict(counts["filtered"])
    filtered[CONTAMINATED] = filtered.get(CONTAMINATED, 0) + removed
    new = {**counts, "kept": counts["kept"] - removed, "filtered": dict(sorted(filtered.items()))}
    groups = ("filtered", "duplicates", "quarantined")
    total = new["kept"] + sum(sum(new[group].values()) for group in groups)
    if total != new["read"] or new["kept"] < 0:
        raise AssertionError(f"counts do not reconcile: read={new['read']}, accounted={total}")
    return new


def decontamination_metrics(report: DecontaminationReport, elapsed_s: float) -> dict[str, float]:
    """The stage's own figures: documents removed, per eval set, its n-grams, and the time."""
    metrics = {
        "documents_removed": float(report.documents_removed),
        "decontamination_s": round(elapsed_s, 3),
    }
    for name, count in report.removed_by.items():
        metrics[f"removed_by.{_NOT_METRIC.sub('_', name)}"] = float(count)
    for name, count in report.eval_ngrams.items():
        metrics[f"eval_ngrams.{_NOT_METRIC.sub('_', name)}"] = float(count)
    return metrics


@stage_task(STAGE, plan_decontaminate, complete_output)
def decontaminate_task(cfg: DecontaminateConfig, ingest_dir: str, workspace: str) -> dict[str, Any]:
    """Decontaminate the ingest output (or reuse a complete output); return its summary.

    The summary's `stage` is `decontaminate` (its manifest says `ingest`, its format); with
    decontamination disabled its `path` is the ingest output's. Prefect's cache key is the
    output's fingerprint (`tasks.common.caching`), as for every stage.
    """
    rebuild = refresh_requested()
    result = run_decontaminate(cfg, Path(ingest_dir), Path(workspace), rebuild)
    report = result.manifest.get("decontamination")
    if report is not None and cfg.enabled:
        get_run_logger().info(
            "decontaminate %s: %s, %s of %s documents removed (%s)",
            result.manifest["fingerprint"],
            "reused" if result.reused else "built",
            report["documents_removed"],
            report["documents_read"],
            report["removed_by"],
        )
    return result.summary() | {"stage": STAGE}
