"""Compare two workspaces that ran the same recipe: what must be the same bits, and what may differ.

Used by the pipeline flow test (two fresh workspaces, one recipe). The rules are the ones
docs/pipeline.md, "Same recipe, same bits", lists:

- byte-identical: every other file, the Arrow shards of every data stage, the tokenizer, the
  dedup index, the quarantine and the exported weights (pretrained and fine-tuned) included;
- equal by value, leaving out timings, run ids and paths: the JSON records a run writes
  (`steps.jsonl`, `evals.jsonl`, the fine-tuning's `history.jsonl` and `result.json`, the
  evaluation, manifests and run records);
- not compared: what records a moment, a place or a process rather than a result (MLflow's
  store and its run records, Prefect's results and home, the workspace's random id, process
  ids, and the HTML/Markdown reports and model cards that print timings, paths and run ids).
"""

from __future__ import annotations

import json
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import yaml

# Timings and wall-clock values: what a second run legitimately changes.
TIMING_KEYS = frozenset(
    {
        "step_time_s",
        "tokens_per_s",
        "samples_per_s",
        "mfu",
        "elapsed_s",
        "training_s",
        "train_time_s",
        "started_at",
        "finished_at",
        "created_at",
        "wall_s",
        "throughput_mb_s",
    }
)
# Digests of a record that holds paths (a checkpoint's meta.json hashes itself).
PATH_DIGEST_KEYS = frozenset({"meta_sha256"})
# Files whose bytes hold paths or moments: compared by value (or not at all), so a manifest's
# size and sha256 of them are not compared either.
TEXT_RECORDS = (".json", ".jsonl", ".yaml", ".md", ".html")
# Identities of one run in MLflow or of one process, not of the result.
RUN_ID_KEYS = frozenset({"mlflow_run_id", "parent_run_id", "run_uuid", "pid", "hostname"})
# Records of a moment or a process, never compared (docs/pipeline.md lists them with why).
NOT_COMPARED = (
    "mlflow.db",
    "workspace.json",
    "mlflow-runs/*",
    "mlartifacts/*",
    "prefect-results/*",
    ".prefect/*",
    ".cache/*",
    "*/pids/*",
    "*.html",
    "*/report.md",
    "*/evaluation.md",
    "*/README.md",
)
VALUE_SUFFIXES = (".json", ".jsonl", ".yaml")


def normalised(value: Any, roots: tuple[str, ...], ignore: frozenset[str] = frozenset()) -> Any:
    """`value` without timings, run ids and `ignore`d keys, its workspace and inputs relative."""
    if isinstance(value, dict):
        skip = TIMING_KEYS | RUN_ID_KEYS | PATH_DIGEST_KEYS | ignore
        if str(value.get("name", "")).endswith(TEXT_RECORDS):  # a manifest's entry of such a file
            skip |= {"bytes", "sha256"}
        return {k: normalised(v, roots, ignore) for k, v in value.items() if k not in skip}
    if isinstance(value, list):
        return [normalised(v, roots, ignore) for v in value]
    if isinstance(value, str):
        for root in roots:
            value = value.replace(root, "<root>")
    return value


def _records(path: Path, roots: tuple[str, ...], ignore: frozenset[str]) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".yaml":
        return normalised(yaml.safe_load(text), roots, ignore)
    if path.suffix == ".jsonl":
        return [normalised(json.loads(line), roots, ignore) for line in text.splitlines() if line]
    return normalised(json.loads(text), roots, ignore)


def _not_compared(name: str) -> bool:
    return any(fnmatch(name, pattern) for pattern in NOT_COMPARED)


def _files(root: Path) -> dict[str, Path]:
    return {
        path.relative_to(root).as_posix(): path
        for path in sorted(root.rglob("*"))
        if path.is_file() and not _not_compared(path.relative_to(root).as_posix())
    }


def workspace_differences(
    first: Path,
    second: Path,
    inputs: tuple[Path | str, ...] | tuple[tuple[Path | str, ...], tuple[Path | str, ...]] = (),
    ignore: frozenset[str] = frozenset(),
) -> list[str]:
    """Every file of two workspaces of one recipe that breaks the same-bits rules, with why.

    Args:
        first: One workspace.
        second: The other; the same stage output directories (fingerprints) must be in both.
        inputs: The two runs' input directories, when they lie outside the workspaces, so that
            paths into them compare equal; or two tuples, each run's own strings that stand
            for the same thing (directories, keys), longest first where one holds another.
        ignore: Keys of the records not compared either (two commits' `git_commit`, say).
    """
    own_a, own_b = inputs if inputs and isinstance(inputs[0], tuple) else (inputs[:1], inputs[1:])
    roots_a = tuple(str(p) for p in (first, *own_a))
    roots_b = tuple(str(p) for p in (second, *own_b))
    files_a, files_b = _files(first), _files(second)
    problems = [f"only in {first}: {name}" for name in sorted(set(files_a) - set(files_b))]
    problems += [f"only in {second}: {name}" for name in sorted(set(files_b) - set(files_a))]
    for name in sorted(set(files_a) & set(files_b)):
        a, b = files_a[name], files_b[name]
        if name.endswith(VALUE_SUFFIXES):
            if _records(a, roots_a, ignore) != _records(b, roots_b, ignore):
                problems.append(f"differs by value: {name}")
        elif a.read_bytes() != b.read_bytes():
            problems.append(f"differs in bytes: {name}")
    return problems
