"""The ingestion driver: plan units, run them on Ray, dedup, cut shards, write the manifest.

Layout of one output, `<workspace>/ingest/<fingerprint>/`:
`{split}-g{generation}-{index:05d}.arrow` shards (Arrow IPC stream), `quarantine.jsonl`,
`dedup_index.arrow` (hashes and signatures of kept documents, for incremental ingests) and
`manifest.json`, written last. `_staging/` holds per-unit results while a run is in progress.

The fingerprint names the inputs by content, never by place: each input's bytes' hash (the
workspace's stat cache skips re-hashing an unchanged file, `tasks/ingest/input_hashes.py`), its
path relative to its source and the source's settings, and the config without the sources'
paths. A moved or copied corpus (or workspace) keeps its fingerprint; the manifest still shows
each input's `uri` and the config as given.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from tasks.common import schema
from tasks.common.caching import refresh_requested, stage_task
from tasks.common.io import (
    fingerprint,
    public_dump,
    read_ipc_stream,
    safe_join,
)
from tasks.common.progress import make_reporter, ticker
from tasks.common.ray_runtime import RayConfig, run_units
from tasks.common.stage import StageOutput, StageResult, files_complete, plan_output
from tasks.ingest.ingest import (
    IngestConfig,
    UnitJob,
    process_unit,
    write_shard,
)
from tasks.ingest.input_hashes import InputHashes
from tasks.ingest.output import (
    dedup_documents,
    ingest_metrics,
    load_keys,
    mixture,
    reconcile_counts,
    shard_jobs,
    split_entries,
    write_dedup_index,
    write_quarantine,
)
from tasks.ingest.readers import plan_units
from tasks.ingest.sources import InputFile, WorkUnit, expand_source, work_bytes
from tasks.ingest.text import resolve_splitter

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]
STAGE = "ingest"


def public_config(cfg: IngestConfig) -> dict[str, Any]:
    """Dump `cfg` for manifests and tracking, with every secret left out."""
    return public_dump(cfg)  # type: ignore[no-any-return]


def _inputs(cfg: IngestConfig) -> tuple[list[InputFile], dict[str, dict[str, str]]]:
    files = [f for i, source in enumerate(cfg.sources) for f in expand_source(source, i)]
    storage = {s.display_name(): s.fs_options() for s in cfg.sources}
    return files, storage


def _source_key(cfg: IngestConfig, name: str) -> str:
    source = next(s for s in cfg.sources if s.display_name() == name)
    return fingerprint(
        source.model_dump(mode="json", exclude={"path", "weight", "storage_options"})
    )


def plan_ingest(cfg: IngestConfig, workspace: Path | str) -> StageOutput:
    """Plan the ingest output of `cfg`: fingerprint (inputs' bytes, config, code) and place."""
    return _planned(cfg, *_inputs(cfg), Path(workspace))


def _planned(
    cfg: IngestConfig,
    files: list[InputFile],
    storage: dict[str, dict[str, str]],
    workspace: Path,
) -> StageOutput:
    """The planned output; its `inputs` and `config` are the manifest's, uris and paths shown.

    The fingerprint covers all they say except where the inputs lie: each input without its
    `uri` (`content_key` and its format, size, source), the config without the sources' paths.
    """
    hashes = InputHashes.of_workspace(workspace)
    inputs = describe_inputs(cfg, files, storage, hashes)
    hashes.save()
    config = public_config(cfg)
    keyed = {**config, "sources": [_unplaced(s) for s in config["sources"]]}
    identity = [{k: v for k, v in i.items() if k != "uri"} for i in inputs]
    out = plan_output(STAGE, identity, keyed, workspace=workspace)
    return replace(out, inputs=inputs, config=config)


def _unplaced(source: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in source.items() if k != "path"}


def content_key(entry: dict[str, Any]) -> tuple[str, str, str]:
    """What identifies an input across places: its source's settings, relative path, bytes."""
    return (str(entry["source_key"]), str(entry["rel"]), str(entry["xxh3_128"]))


def run_ingest(
    cfg: IngestConfig,
    ray_cfg: RayConfig,
    workspace: Path,
    progress: Progress | None = None,
    rebuild: bool = False,
) -> StageResult:
    """Ingest the configured sources into `<workspace>/ingest/<fingerprint>/`.

    A complete output with the same fingerprint (inputs' bytes, config, code) is reused as it is
    (built again aside and swapped in with `rebuild`); an interrupted one resumes from its staged
    units. With `incremental`, a previous output whose inputs are a subset of these is extended:
    only new files are read, old shards are kept.
    """
    started = time.monotonic()
    resolve_splitter(cfg.sentences)  # a plug-in that cannot be imported is refused up front
    files, storage = _inputs(cfg)
    out = _planned(cfg, files, storage, workspace)
    done = out.reuse(_complete_manifest, rebuild)
    if done is not None:
        return StageResult(out.path, done, reused=True)
    out = out.build_aside() if rebuild else out
    source_hash = str(out.code["source_hash"])
    base = (
        _previous(workspace, cfg, out.config, source_hash, out.inputs) if cfg.incremental else None
    )
    read = {content_key(i) for i in base["inputs"]} if base else set()
    new_files = [f for f, i in zip(files, out.inputs, strict=True) if content_key(i) not in read]
    staging = out.open_staging()  # deletes the temp files of a killed run: never read as outputs
    units = _plan(new_files, cfg, max(int(cfg.unit_size_mb * (1 << 20)), 1), storage)
    summaries = _read_units(units, cfg, ray_cfg, staging, storage, progress)
    manifest = {
        "stage": STAGE,
        "schema_version": schema.SCHEMA_VERSION,
        "fingerprint": out.fingerprint,
        "schema": [str(f) for f in schema.DOCUMENTS],
        "config": out.config,
        "code": out.code,
        "incremental_key": fingerprint({k: v for k, v in out.config.items() if k != "sources"}),
        "inputs": out.inputs,
        **_finish(out.path, cfg, ray_cfg, units, summaries, base, progress),
        "elapsed_s": round(time.monotonic() - started, 3),
    }
    manifest["metrics"] = ingest_metrics(manifest)
    return out.commit(manifest)


def describe_inputs(
    cfg: IngestConfig,
    files: list[InputFile],
    storage: dict[str, dict[str, str]],
    hashes: InputHashes | None = None,
) -> list[dict[str, Any]]:
    """Describe each input file for the manifest, its bytes' hash included.

    `hashes` answers for a local file whose stat is unchanged since it was hashed (None: every
    file is hashed). The fingerprint takes each description without its `uri`.
    """
    hashes = hashes or InputHashes(None)
    return [
        {
            "source": f.source,
            "uri": f.uri,
            "rel": f.rel,
            "format": f.format,
            "compression": f.compression,
            "size": f.size,
            "xxh3_128": hashes.digest(f, storage[f.source]),
            "source_key": _source_key(cfg, f.source),
        }
        for f in files
    ]


def _plan(
    files: list[InputFile], cfg: IngestConfig, unit_bytes: int, storage: dict[str, dict[str, str]]
) -> list[WorkUnit]:
    units: list[WorkUnit] = []
    for source in cfg.sources:
        mine = [f for f in files if f.source == source.display_name()]
        for unit in plan_units(mine, source.txt_mode, unit_bytes, storage):
            units.append(WorkUnit(len(units), unit.file, unit.start, unit.end, unit.binary))
    return units


def _read_units(
    units: list[WorkUnit],
    cfg: IngestConfig,
    ray_cfg: RayConfig,
    staging: Path,
    storage: dict[str, dict[str, str]],
    progress: Progress | None,
) -> list[dict[str, Any]]:
    """Read every unit into `staging` (on Ray, `run_units`); their summaries, in unit order."""
    tick = ticker(progress, "read", len(units))
    return run_units(
        process_unit,
        [UnitJob(u, cfg, str(staging), storage[u.file.source]) for u in units],
        ray_cfg,
        on_done=tick,
        input_bytes=_input_bytes(units),
    )


def _input_bytes(units: list[WorkUnit]) -> int:
    """The bytes of text `units` read: each input file once (`work_bytes`)."""
    files = {u.file.uri: u.file for u in units}
    return sum(work_bytes(f.size, f.uri) for f in files.values())


def _complete(out: Path, manifest: dict[str, Any]) -> bool:
    files = [s for split in manifest["splits"].values() for s in split["shards"]]
    return files_complete(out, [*files, manifest["quarantine"], manifest["dedup_index"]])


def _complete_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of a complete ingest output at `out` (shards, quarantine, index), else None."""
    path = out / "manifest.json"
    if not path.exists():
        return None
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest if _complete(out, manifest) else None


def _previous(
    workspace: Path,
    cfg: IngestConfig,
    config: dict[str, Any],
    code: str,
    inputs: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """Find the newest complete ingest that this one can extend (same settings, fewer inputs).

    Inputs match by content (`content_key`), so a moved corpus still extends its old output.
    """
    key = fingerprint({k: v for k, v in config.items() if k != "sources"})
    current = {content_key(i) for i in inputs}
    best = None
    for path in sorted((workspace / STAGE).glob("*/manifest.json")):
        manifest = json.loads(path.read_text())
        old = {content_key(i) for i in manifest["inputs"]}
        if manifest.get("incremental_key") != key or manifest["code"]["source_hash"] != code:
            continue
        if (
            old < current
            and _complete(path.parent, manifest)
            and (best is None or len(old) > len(best["inputs"]))
        ):
            best = manifest | {"path": str(path.parent)}
    return best


def _finish(
    out: Path,
    cfg: IngestConfig,
    ray_cfg: RayConfig,
    units: list[WorkUnit],
    summaries: list[dict[str, Any]],
    base: dict[str, Any] | None,
    progress: Progress | None,
) -> dict[str, Any]:
    """Dedup, then write the shards, the quarantine and the dedup index.

    Returns the manifest entries they produce (splits, counts, files, mixture).
    """
    keys = load_keys(out / "_staging", units, cfg.dedup.near.enabled)
    prior = None
    if base:
        prior = read_ipc_stream(safe_join(Path(base["path"]), base["dedup_index"]["name"]))
    dedup = dedup_documents(keys, cfg.dedup, prior)
    generation = (base["generation"] + 1) if base else 0
    jobs, names = shard_jobs(out, units, summaries, keys, dedup.keep, cfg, generation)
    tick = ticker(progress, "write", len(jobs))
    written = run_units(write_shard, jobs, ray_cfg, on_done=tick, input_bytes=_input_bytes(units))
    return {
        "generation": generation,
        "extends": base["fingerprint"] if base else None,
        "splits": split_entries(out, base, names, written),
        "quarantine": write_quarantine(out, units, summaries, base),
        "dedup_index": write_dedup_index(out, keys, dedup.keep, prior),
        "counts": reconcile_counts(summaries, base, dedup),
        "sources": mixture(cfg, units, dedup.keep, keys.sizes, base),
        "units": len(units),
        "ray_workers": ray_cfg.num_workers,
    }


@stage_task(STAGE, plan_ingest, _complete_manifest)
def ingest_task(cfg: IngestConfig, ray_cfg: RayConfig, workspace: str) -> dict[str, Any]:
    """Run ingestion (or reuse a complete output with the same fingerprint); return its summary.

    Prefect's cache key is the output's fingerprint, which covers the inputs' bytes
    (`tasks.common.caching`); a refreshed cache rebuilds the output.
    """
    logger = get_run_logger()
    result = run_ingest(
        cfg, ray_cfg, Path(workspace), make_reporter(logger), rebuild=refresh_requested()
    )
    counts = result.manifest["counts"]
    logger.info(
        "ingest %s: %s (%s)",
        result.manifest["fingerprint"],
        "reused" if result.reused else "built",
        counts,
    )
    return result.summary()
