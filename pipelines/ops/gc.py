"""Workspace housekeeping: which outputs nothing needs any more, and removing them.

Here: `scan_workspace` (every stage output, what names it and what it was built from),
`plan_gc` (keep what a reference names, what was written recently, and everything those were
built from; remove the rest), `apply_plan` (delete), and `collect_references` (what the MLflow
registry and recent runs name). `plan_gc` needs no MLflow: references are plain strings.
Not here: the command line (`pipelines/cli/gc.py`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.common.workspace import relocator

log = logging.getLogger(__name__)

# `<workspace>/<stage>/<fingerprint>/` outputs with a manifest.json.
FINGERPRINTED = ("ingest", "decontaminate", "tokenizer", "encode", "examples", "compare")
# Training runs, `<workspace>/<stage>/<key>/` too (training/runtime/driver.py): `record.json`
# from the start, `manifest.json` once finished.
RUN_STAGES = ("pretrain", "finetune")
NAMED = ("downstream", "evaluate")  # `<workspace>/<stage>/<name>/`
# `tasks.common.io.atomic_writer` and `tasks.common.stage.temp_dir_beside`
TEMP_PATTERN = ".*.tmp-*"
# What a run directory holds from its start (training.runtime.driver.RECORD_FILE).
_RUN_RECORD = "record.json"
# The layout before runs were stage outputs: `<run>/`, `<run>.export/`, `<run>.run.json`
# beside each other, still listed (and kept or removed together).
_LEGACY_SUFFIXES = (".run.json", ".export")
# A legacy fine-tuned export's card names its base model (training/finetune/loop.py, `_card`).
_BASE_ROW = re.compile(r"^\| base model \| (.+) \|$", re.MULTILINE)
_FINGERPRINT = re.compile(r"[0-9a-f]{16,64}$")
_MAX_KEY_CHARS = 1000  # longer tag and param values are config dumps, not names


@dataclass(frozen=True)
class Reference:
    """Something that must stay: a fingerprint, run id, name or absolute path, and who needs it."""

    key: str
    why: str


@dataclass(frozen=True)
class Output:
    """One removable unit of the workspace: its paths go (or stay) together.

    Attributes:
        kind: The stage (`ingest`, ..., `pretrain`, `evaluate`) or `temp` for a leftover.
        name: Its directory name (fingerprint, run id or name) or the temp's file name.
        paths: Every path that belongs to it (a legacy run: its directory, export and record).
        keys: What names it: the name, the manifest's fingerprint, its absolute paths.
        needs: Keys and absolute paths of the outputs it was built from.
        bytes: Size on disk (hard-linked files are counted in every output that links them).
        modified: Newest modification time of its paths and its manifest, in epoch seconds.
    """

    kind: str
    name: str
    paths: tuple[Path, ...]
    keys: frozenset[str]
    needs: frozenset[str]
    bytes: int
    modified: float


@dataclass(frozen=True)
class Decision:
    """Keep or remove one output, and why."""

    output: Output
    keep: bool
    why: str


@dataclass(frozen=True)
class GcPlan:
    """What `lmpipe gc` keeps and removes in one workspace."""

    workspace: Path
    decisions: list[Decision] = field(default_factory=list)

    @property
    def removals(self) -> list[Decision]:
        """The outputs to remove."""
        return [d for d in self.decisions if not d.keep]

    @property
    def bytes_to_free(self) -> int:
        """Bytes the removals take up."""
        return sum(d.output.bytes for d in self.removals)


def plan_gc(
    workspace: Path,
    references: Iterable[Reference],
    *,
    now: float | None = None,
    keep_recent_s: float = 7 * 86400,
) -> GcPlan:
    """Decide, for every output in `workspace`, whether it stays, and why.

    An output stays when a reference names it (by fingerprint, run id, name, or a path at or
    under it), when it was modified within `keep_recent_s` (a run may be writing it, or ran
    with tracking off), or when a staying output was built from it (transitively: a model's
    examples, their encoding, its tokenizer and corpus). Everything else is removed, temp
    leftovers of killed runs included. A path that a reference or a record names under a place
    the workspace lived at before a copy or a move names the same output here (`relocator`).
    """
    workspace = workspace.resolve()
    now = time.time() if now is None else now
    outputs = scan_workspace(workspace)
    move = relocator(workspace)
    found = _resolver(outputs)

    def resolve(key: str) -> list[int]:
        return found(move(key))

    why: dict[int, str] = {}
    for ref in references:
        for i in resolve(ref.key):
            why.setdefault(i, ref.why)
    for i, out in enumerate(outputs):
        age_s = now - out.modified
        if age_s < keep_recent_s:
            why.setdefault(i, f"modified {age_s / 3600:.1f} h ago")
    queue = deque(why)
    while queue:
        i = queue.popleft()
        for need in sorted(outputs[i].needs):
            for j in resolve(need):
                if j not in why:
                    why[j] = f"input of {outputs[i].kind}/{outputs[i].name}"
                    queue.append(j)
    decisions = []
    for i, out in enumerate(outputs):
        if i in why:
            decisions.append(Decision(out, True, why[i]))
        elif out.kind == "temp":
            decisions.append(Decision(out, False, "temp leftover of an interrupted write"))
        else:
            decisions.append(Decision(out, False, "no registered model or recent run needs it"))
    return GcPlan(workspace, decisions)


def _resolver(outputs: list[Output]) -> Callable[[str], list[int]]:
    by_key: dict[str, list[int]] = {}
    for i, out in enumerate(outputs):
        for key in out.keys:
            by_key.setdefault(key, []).append(i)

    def resolve(key: str) -> list[int]:
        if key in by_key:
            return by_key[key]
        if not key.startswith("/"):
            return []
        # Outputs are keyed by resolved paths; a path under one (a checkpoint, a file of an
        # export) names it.
        path = Path(os.path.realpath(key))
        for candidate in (path, *path.parents):
            if str(candidate) in by_key:
                return by_key[str(candidate)]
        return []

    return resolve


def scan_workspace(workspace: Path) -> list[Output]:
    """List every stage output and temp leftover under `workspace` (absolute)."""
    outputs: list[Output] = []
    for stage in (*FINGERPRINTED, *RUN_STAGES, *NAMED):
        root = workspace / stage
        if not root.is_dir():
            continue
        entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
        if stage in RUN_STAGES:
            runs = [p for p in entries if _is_run_dir(p)]
            legacy = [p for p in entries if p not in runs]
            outputs += [_legacy_run(stage, root, run) for run in _legacy_names(legacy)]
        else:
            runs = [p for p in entries if p.is_dir()]
        outputs += [_dir_output(stage, p) for p in runs]
        outputs += [_temp(p) for p in sorted(root.glob(TEMP_PATTERN))]
        for out in entries:
            if out.is_dir() and not out.is_symlink():
                outputs += [_temp(p) for p in sorted(out.glob(TEMP_PATTERN))]
    return outputs


def _is_run_dir(path: Path) -> bool:
    """A training run of the stage layout: a directory with its record or manifest."""
    is_dir = path.is_dir() and not path.is_symlink()
    return is_dir and any((path / name).is_file() for name in (_RUN_RECORD, "manifest.json"))


def _legacy_names(entries: list[Path]) -> list[str]:
    runs = set()
    for path in entries:
        name = path.name
        for suffix in _LEGACY_SUFFIXES:
            name = name.removesuffix(suffix)
        runs.add(name)
    return sorted(runs)


def _dir_output(stage: str, path: Path) -> Output:
    # A training run that has not finished has no manifest yet; its record names its inputs.
    manifest = _read_json(path / "manifest.json") or _read_json(path / _RUN_RECORD)
    keys = {path.name, str(path)}
    needs: set[str] = set()
    if manifest:
        keys.add(str(manifest.get("fingerprint", path.name)))
        needs = _manifest_needs(manifest)
    if stage == "compare":
        needs.add(path.name)  # named after the fingerprint of the task data it compared on
    if stage == "evaluate":
        result = _read_json(path / "evaluation.json")
        needs |= {str(result[k]) for k in ("model_dir", "task_dir") if result.get(k)}
    return _output(stage, path.name, (path,), keys, needs, path / "manifest.json")


def _manifest_needs(manifest: dict[str, Any]) -> set[str]:
    """The fingerprints and paths of a stage's inputs, as its manifest records them."""
    needs = set()
    inputs = manifest.get("inputs")
    if isinstance(inputs, dict):  # ingest's inputs are its corpus files: no upstream output
        needs |= {v for v in inputs.values() if isinstance(v, str) and _FINGERPRINT.match(v)}
    for value in manifest.values():  # "ingest": {"fingerprint", "path"}, "tokenizer": ...
        if isinstance(value, dict) and {"fingerprint", "path"} <= value.keys():
            needs |= {str(value["fingerprint"]), str(value["path"])}
    if "decontaminated_from" in manifest:
        needs.add(str(manifest["decontaminated_from"]))
    return needs - {str(manifest.get("fingerprint"))}


def _legacy_run(stage: str, root: Path, run: str) -> Output:
    run_dir = root / run
    paths = [run_dir, root / f"{run}.export", root / f"{run}.run.json"]
    paths = [p for p in paths if p.exists() or p.is_symlink()]
    needs: set[str] = set()
    metas = sorted(run_dir.glob("checkpoint_step-*/meta.json")) if stage == "pretrain" else []
    if metas:  # what the run trained on
        meta = _read_json(metas[-1])
        needs |= {str(meta[k]) for k in ("examples_dir", "tokenizer_dir") if meta.get(k)}
    card = run_dir / "export" / "README.md"
    if stage == "finetune" and card.is_file():
        needs |= {m.group(1).strip() for m in _BASE_ROW.finditer(card.read_text())}
    keys = {run, *(str(p) for p in paths)}
    return _output(stage, run, tuple(paths), keys, needs, root / f"{run}.run.json")


def _temp(path: Path) -> Output:
    return _output("temp", path.name, (path,), {str(path)}, set(), path)


def _output(
    kind: str, name: str, paths: tuple[Path, ...], keys: set[str], needs: set[str], marker: Path
) -> Output:
    times = [p.lstat().st_mtime for p in (*paths, marker) if p.exists() or p.is_symlink()]
    return Output(
        kind=kind,
        name=name,
        paths=paths,
        keys=frozenset(keys),
        needs=frozenset(needs),
        bytes=sum(_size(p) for p in paths),
        modified=max(times, default=0.0),
    )


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except FileNotFoundError:  # removed while we walk (a temp being renamed)
                continue
    return total


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def apply_plan(plan: GcPlan) -> int:
    """Delete every output the plan removes; return the bytes freed.

    Raises:
        ValueError: a path to remove is not inside the plan's workspace (never deleted).
    """
    freed = 0
    for decision in plan.removals:
        for path in decision.output.paths:
            parent = path.parent.resolve()  # the path itself may be a symlink: never followed
            if plan.workspace not in parent.parents and parent != plan.workspace:
                raise ValueError(f"{path} is outside the workspace {plan.workspace}")
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        freed += decision.output.bytes
        log.info("removed %s/%s (%d bytes)", decision.output.kind, decision.output.name, freed)
    return freed


def collect_references(tracking_uri: str, *, keep_days: float, now: float) -> list[Reference]:
    """What the MLflow store at `tracking_uri` still needs from the workspace.

    Every registered model version (its lineage tags, and the tags, params and name of the
    run that logged it), and every run of any experiment started within `keep_days` or still
    running. Tag and param values are taken as keys: stage runs tag `lmpipe.fingerprint`,
    pretraining runs `train_run`, fine-tuning runs `finetune_run` and `base_model_path`.
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri)
    refs: list[Reference] = []
    for mv in _pages(client.search_model_versions):
        why = f"model {mv.name} v{mv.version}"
        refs += [Reference(v, why) for v in _names(mv.tags)]
        if mv.run_id:
            try:
                refs += _run_references(client.get_run(mv.run_id), why)
            except MlflowException:  # the run was deleted; the version's own tags still count
                log.info("model %s v%s: run %s not found", mv.name, mv.version, mv.run_id)
    experiments = [e.experiment_id for e in _pages(client.search_experiments)]
    if not experiments:
        return refs
    cutoff_ms = int((now - keep_days * 86400) * 1000)
    for query in (f"attributes.start_time >= {cutoff_ms}", "attributes.status = 'RUNNING'"):
        for run in _pages(client.search_runs, experiment_ids=experiments, filter_string=query):
            age_d = (now * 1000 - run.info.start_time) / 86_400_000
            why = f"run {run.info.run_name} ({run.info.status.lower()}, {age_d:.1f} d ago)"
            refs += _run_references(run, why)
    return refs


def _run_references(run: Any, why: str) -> list[Reference]:
    tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
    refs = [Reference(v, why) for v in (*_names(tags), *_names(run.data.params))]
    stage = tags.get("lmpipe.stage") or tags.get("stage")
    name = run.info.run_name or ""
    if stage and name.endswith(f"-{stage}"):  # `<recipe name>-evaluate` wrote evaluate/<name>
        refs.append(Reference(name.removesuffix(f"-{stage}"), why))
    return refs


def _names(values: dict[str, str]) -> Iterator[str]:
    for value in values.values():
        value = str(value).strip()
        if value and len(value) <= _MAX_KEY_CHARS:
            yield value


def _pages(search: Any, **kwargs: Any) -> Iterator[Any]:
    token = None
    while True:
        page = search(page_token=token, **kwargs)
        yield from page
        token = page.token
        if not token:
            return
