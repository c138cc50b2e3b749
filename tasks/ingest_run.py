"""The ingestion driver: plan units, run them on Ray, dedup, cut shards, write the manifest.

Layout of one output, `<workspace>/ingest/<fingerprint>/`:
`{split}-g{generation}-{index:05d}.arrow` shards (Arrow IPC stream), `quarantine.jsonl`,
`dedup_index.arrow` (hashes and signatures of kept documents, for incremental ingests) and
`manifest.json`, written last. `_staging/` holds per-unit results while a run is in progress.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks import schema
from tasks.dedup import HASH_HI, HASH_LO, MINHASH, exact_keep_mask, near_keep_mask
from tasks.ingest import (
    SPLITS,
    IngestConfig,
    ShardJob,
    UnitJob,
    assign_split,
    process_unit,
    write_shard,
)
from tasks.io import (
    atomic_writer,
    code_version,
    fingerprint,
    public_dump,
    read_ipc_stream,
    safe_join,
    sha256_file,
    write_ipc_stream,
    write_json_atomic,
)
from tasks.progress import make_reporter
from tasks.ray_runtime import RayConfig, ensure_ray, map_bounded
from tasks.readers import plan_units
from tasks.sources import InputFile, WorkUnit, expand_source
from tasks.text import resolve_splitter

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]
STAGE = "ingest"


@dataclass(frozen=True)
class IngestResult:
    """Where an ingest's output is, its manifest, and whether it was reused as it was."""

    path: Path
    manifest: dict[str, Any]
    reused: bool


def public_config(cfg: IngestConfig) -> dict[str, Any]:
    """Dump `cfg` for manifests and tracking, with every secret left out."""
    return public_dump(cfg)  # type: ignore[no-any-return]


def file_fingerprint(file: InputFile, storage: dict[str, str]) -> str:
    """Hash an input's bytes (every file of a saved dataset) with xxh3-128."""
    import fsspec

    digest = xxhash.xxh3_128()
    paths = [file.uri]
    if file.format == "hf_disk":
        fs, root = fsspec.core.url_to_fs(file.uri, **storage)
        paths = sorted(fs.find(root))
    for path in paths:
        with fsspec.open(path, "rb", **storage) as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _inputs(cfg: IngestConfig) -> tuple[list[InputFile], dict[str, dict[str, str]]]:
    files = [f for i, source in enumerate(cfg.sources) for f in expand_source(source, i)]
    storage = {s.display_name(): s.fs_options() for s in cfg.sources}
    return files, storage


def _source_key(cfg: IngestConfig, name: str) -> str:
    source = next(s for s in cfg.sources if s.display_name() == name)
    return fingerprint(
        source.model_dump(mode="json", exclude={"path", "weight", "storage_options"})
    )


def run_ingest(
    cfg: IngestConfig, ray_cfg: RayConfig, workspace: Path, progress: Progress | None = None
) -> IngestResult:
    """Ingest the configured sources into `<workspace>/ingest/<fingerprint>/`.

    A complete output with the same fingerprint (inputs' bytes, config, code) is reused as it is;
    an interrupted one resumes from its staged units. With `incremental`, a previous output whose
    inputs are a subset of these is extended: only new files are read, old shards are kept.
    """
    started = time.monotonic()
    resolve_splitter(cfg.sentences)  # a plug-in that cannot be imported is refused up front
    files, storage = _inputs(cfg)
    inputs = [
        {
            "source": f.source,
            "uri": f.uri,
            "rel": f.rel,
            "format": f.format,
            "compression": f.compression,
            "size": f.size,
            "xxh3_128": file_fingerprint(f, storage[f.source]),
            "source_key": _source_key(cfg, f.source),
        }
        for f in files
    ]
    code = code_version("tasks")
    source_hash = str(code["source_hash"])
    config = public_config(cfg)
    fp = fingerprint({"inputs": inputs, "config": config, "code": source_hash})
    out = workspace / STAGE / fp
    if (out / "manifest.json").exists():
        manifest = json.loads((out / "manifest.json").read_text())
        if _complete(out, manifest):
            return IngestResult(out, manifest, reused=True)
    base = _previous(workspace, cfg, config, source_hash, inputs) if cfg.incremental else None
    done_uris = {i["uri"] for i in base["inputs"]} if base else set()
    new_files = [f for f in files if f.uri not in done_uris]
    staging = out / "_staging"
    staging.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob(".*.tmp-*"), *staging.glob(".*.tmp-*")]:
        stale.unlink(missing_ok=True)  # temp files of a killed run; never read as outputs
    unit_bytes = max(int(cfg.unit_size_mb * (1 << 20)), 1)
    units = _plan(new_files, cfg, unit_bytes, storage)
    ensure_ray(ray_cfg)
    tick = _ticker(progress, "read", len(units))
    summaries = map_bounded(
        process_unit,
        [UnitJob(u, cfg, str(staging), storage[u.file.source]) for u in units],
        ray_cfg.num_workers,
        on_done=tick,
    )
    manifest = _finish(
        out, cfg, ray_cfg, units, summaries, base, inputs, config, code, fp, progress
    )
    manifest["elapsed_s"] = round(time.monotonic() - started, 3)
    write_json_atomic(out / "manifest.json", manifest)
    shutil.rmtree(staging, ignore_errors=True)
    return IngestResult(out, manifest, reused=False)


def _plan(
    files: list[InputFile], cfg: IngestConfig, unit_bytes: int, storage: dict[str, dict[str, str]]
) -> list[WorkUnit]:
    units: list[WorkUnit] = []
    for source in cfg.sources:
        mine = [f for f in files if f.source == source.display_name()]
        for unit in plan_units(mine, source.txt_mode, unit_bytes, storage):
            units.append(WorkUnit(len(units), unit.file, unit.start, unit.end, unit.binary))
    return units


def _ticker(progress: Progress | None, phase: str, total: int) -> Callable[[int, Any], None]:
    done = [0]

    def tick(_index: int, _result: Any) -> None:
        done[0] += 1
        if progress is not None:
            progress(phase, done[0], total)

    return tick


def _complete(out: Path, manifest: dict[str, Any]) -> bool:
    files = [s for split in manifest["splits"].values() for s in split["shards"]]
    files += [manifest["quarantine"], manifest["dedup_index"]]
    return all(
        safe_join(out, f["name"], what="manifest file").is_file()
        and safe_join(out, f["name"], what="manifest file").stat().st_size == f["bytes"]
        for f in files
    )


def _previous(
    workspace: Path,
    cfg: IngestConfig,
    config: dict[str, Any],
    code: str,
    inputs: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """Find the newest complete ingest that this one can extend (same settings, fewer inputs)."""
    key = fingerprint({k: v for k, v in config.items() if k != "sources"})
    current = {(i["uri"], i["xxh3_128"], i["source_key"]) for i in inputs}
    best = None
    for path in sorted((workspace / STAGE).glob("*/manifest.json")):
        manifest = json.loads(path.read_text())
        old = {(i["uri"], i["xxh3_128"], i["source_key"]) for i in manifest["inputs"]}
        if manifest.get("incremental_key") != key or manifest["code"]["source_hash"] != code:
            continue
        if (
            old < current
            and _complete(path.parent, manifest)
            and (best is None or len(old) > len(best["inputs"]))
        ):
            best = manifest | {"path": str(path.parent)}
    return best


def _staged(staging: Path, index: int, columns: list[str]) -> pa.Table:
    return read_ipc_stream(staging / f"unit-{index:06d}.docs.arrow", columns)


def _finish(
    out: Path,
    cfg: IngestConfig,
    ray_cfg: RayConfig,
    units: list[WorkUnit],
    summaries: list[dict[str, Any]],
    base: dict[str, Any] | None,
    inputs: list[dict[str, Any]],
    config: dict[str, Any],
    code: dict[str, Any],
    fp: str,
    progress: Progress | None,
) -> dict[str, Any]:
    staging = out / "_staging"
    cols = [HASH_HI, HASH_LO] + ([MINHASH] if cfg.dedup.near.enabled else [])
    per_unit = [_staged(staging, u.index, [*cols, schema.TEXT]) for u in units]
    sizes = [len(t) for t in per_unit]
    hi = np.concatenate(
        [t.column(HASH_HI).to_numpy() for t in per_unit] or [np.empty(0, np.uint64)]
    )
    lo = np.concatenate(
        [t.column(HASH_LO).to_numpy() for t in per_unit] or [np.empty(0, np.uint64)]
    )
    prior = (
        read_ipc_stream(safe_join(Path(base["path"]), base["dedup_index"]["name"]))
        if base
        else None
    )
    keep = (
        exact_keep_mask(
            hi,
            lo,
            prior.column(HASH_HI).to_numpy() if prior else None,
            prior.column(HASH_LO).to_numpy() if prior else None,
        )
        if cfg.dedup.exact
        else np.ones(len(hi), dtype=bool)
    )
    exact_dupes = int((~keep).sum())
    signatures = None
    if cfg.dedup.near.enabled:
        signatures = pa.concat_arrays([t.column(MINHASH).combine_chunks() for t in per_unit])
        sig_np = signatures.values.to_numpy().reshape(-1, cfg.dedup.near.num_perm)
        prior_sig = (
            prior.column(MINHASH)
            .combine_chunks()
            .values.to_numpy()
            .reshape(-1, cfg.dedup.near.num_perm)
            if prior
            else np.empty((0, 1))
        )
        survivors = np.flatnonzero(keep)
        near = near_keep_mask((sig_np[i] for i in survivors), cfg.dedup.near, iter(prior_sig))
        keep[survivors[~np.array(near, dtype=bool)]] = False
    near_dupes = int(len(hi) - exact_dupes - keep.sum())
    split_of = assign_split(hi, cfg.split)
    text_bytes = np.concatenate(
        [pc.binary_length(t.column(schema.TEXT)).to_numpy() for t in per_unit]
        or [np.empty(0, np.int64)]
    )
    generation = (base["generation"] + 1) if base else 0
    jobs, names = _shard_jobs(
        out, units, summaries, sizes, keep, split_of, text_bytes, cfg, generation
    )
    tick = _ticker(progress, "write", len(jobs))
    written = map_bounded(write_shard, jobs, ray_cfg.num_workers, on_done=tick)
    splits = _split_entries(out, base, names, written)
    quarantine = _write_quarantine(out, units, base)
    index_cols = {HASH_HI: pa.array(hi[keep]), HASH_LO: pa.array(lo[keep])}
    if signatures is not None:
        index_cols[MINHASH] = signatures.filter(pa.array(keep))
    index = pa.table(index_cols)
    if prior is not None:
        index = pa.concat_tables([prior, index])
    write_ipc_stream(index, out / "dedup_index.arrow")
    counts = _counts(summaries, base, int(keep.sum()), exact_dupes, near_dupes)
    return {
        "stage": STAGE,
        "schema_version": schema.SCHEMA_VERSION,
        "fingerprint": fp,
        "schema": [str(f) for f in schema.DOCUMENTS],
        "config": config,
        "code": code,
        "incremental_key": fingerprint({k: v for k, v in config.items() if k != "sources"}),
        "generation": generation,
        "extends": base["fingerprint"] if base else None,
        "inputs": inputs,
        "counts": counts,
        "splits": splits,
        "quarantine": quarantine,
        "dedup_index": {
            "name": "dedup_index.arrow",
            "rows": index.num_rows,
            "bytes": (out / "dedup_index.arrow").stat().st_size,
            "sha256": sha256_file(out / "dedup_index.arrow"),
        },
        "sources": _mixture(cfg, units, keep, sizes, base),
        "units": len(units),
        "ray_workers": ray_cfg.num_workers,
    }


def _shard_jobs(
    out: Path,
    units: list[WorkUnit],
    summaries: list[dict[str, Any]],
    sizes: list[int],
    keep: np.ndarray,
    split_of: np.ndarray,
    text_bytes: np.ndarray,
    cfg: IngestConfig,
    generation: int,
) -> tuple[list[ShardJob], list[tuple[str, str]]]:
    """Cut the kept documents, in key order, into shards of about `shard_size_mb` per split."""
    target = cfg.shard_size_mb * (1 << 20)
    line_base: list[int] = []
    seen: Counter[str] = Counter()
    for unit, summary in zip(units, summaries, strict=True):
        line_base.append(seen[unit.file.uri])
        seen[unit.file.uri] += summary["newlines"]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    jobs: list[ShardJob] = []
    names: list[tuple[str, str]] = []
    for split_id, split in enumerate(SPLITS):
        parts: list[tuple[int, str, str, int, np.ndarray]] = []
        size = 0.0
        for unit in units:
            lo, hi = starts[unit.index], starts[unit.index + 1]
            rows = np.flatnonzero(keep[lo:hi] & (split_of[lo:hi] == split_id))
            while len(rows):
                # Two bytes per text byte: the sentences column repeats the text.
                cum = size + 2.0 * np.cumsum(text_bytes[lo + rows])
                take = max(int(np.searchsorted(cum, target, side="left")) + 1, 1)
                take = min(take, len(rows))
                parts.append(
                    (
                        unit.index,
                        unit.file.source,
                        unit.file.rel,
                        line_base[unit.index],
                        rows[:take],
                    )
                )
                size = float(cum[take - 1])
                rows = rows[take:]
                if size >= target:
                    name = f"{split}-g{generation}-{sum(n[0] == split for n in names):05d}.arrow"
                    jobs.append(ShardJob(str(out / name), str(out / "_staging"), tuple(parts)))
                    names.append((split, name))
                    parts, size = [], 0.0
        if parts:
            name = f"{split}-g{generation}-{sum(n[0] == split for n in names):05d}.arrow"
            jobs.append(ShardJob(str(out / name), str(out / "_staging"), tuple(parts)))
            names.append((split, name))
    return jobs, names


def _split_entries(
    out: Path,
    base: dict[str, Any] | None,
    names: list[tuple[str, str]],
    written: list[dict[str, Any]],
) -> dict[str, Any]:
    splits: dict[str, Any] = {s: {"rows": 0, "shards": []} for s in SPLITS}
    if base:
        for split, entry in base["splits"].items():
            for shard in entry["shards"]:
                _link(safe_join(Path(base["path"]), shard["name"]), safe_join(out, shard["name"]))
                splits[split]["shards"].append(shard)
                splits[split]["rows"] += shard["rows"]
    for (split, name), info in zip(names, written, strict=True):
        splits[split]["shards"].append({"name": name, **info})
        splits[split]["rows"] += info["rows"]
    return splits


def _link(src: Path, dst: Path) -> None:
    """Hard-link an old shard into the new output (copy across file systems), atomically."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _write_quarantine(
    out: Path, units: list[WorkUnit], base: dict[str, Any] | None
) -> dict[str, Any]:
    """Merge per-unit quarantine records, in unit order, into `quarantine.jsonl`."""
    rows = 0
    with atomic_writer(out / "quarantine.jsonl", "w") as handle:
        if base:
            with open(safe_join(Path(base["path"]), base["quarantine"]["name"])) as old:
                for line in old:
                    handle.write(line)
                    rows += 1
        for unit in units:
            table = read_ipc_stream(out / "_staging" / f"unit-{unit.index:06d}.bad.arrow")
            for record in table.to_pylist():
                record[schema.EXCERPT] = record[schema.EXCERPT].decode("utf-8", "backslashreplace")
                handle.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
                rows += 1
    path = out / "quarantine.jsonl"
    return {
        "name": path.name,
        "rows": rows,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def _counts(
    summaries: list[dict[str, Any]], base: dict[str, Any] | None, kept: int, exact: int, near: int
) -> dict[str, Any]:
    filtered: Counter[str] = Counter()
    quarantined: Counter[str] = Counter()
    read = 0
    for summary in summaries:
        read += summary["read"]
        filtered.update(summary["filtered"])
        quarantined.update(summary["quarantined"])
    duplicates = {"exact": exact, "near": near}
    if base:
        old = base["counts"]
        read += old["read"]
        kept += old["kept"]
        filtered.update(old["filtered"])
        quarantined.update(old["quarantined"])
        duplicates = {k: duplicates[k] + old["duplicates"][k] for k in duplicates}
    counts = {
        "read": read,
        "kept": kept,
        "filtered": dict(sorted(filtered.items())),
        "duplicates": duplicates,
        "quarantined": dict(sorted(quarantined.items())),
    }
    total = kept + sum(filtered.values()) + sum(duplicates.values()) + sum(quarantined.values())
    if total != read:  # an invariant of the stage, not a data problem: fail loudly
        raise AssertionError(f"ingest counts do not reconcile: read={read}, accounted={total}")
    return counts


def _mixture(
    cfg: IngestConfig,
    units: list[WorkUnit],
    keep: np.ndarray,
    sizes: list[int],
    base: dict[str, Any] | None,
) -> dict[str, Any]:
    """Per-source kept documents and the sampling fraction each source's weight implies."""
    docs: Counter[str] = Counter(
        {k: v["documents"] for k, v in (base or {}).get("sources", {}).items()}
    )
    start = 0
    for unit, size in zip(units, sizes, strict=True):
        docs[unit.file.source] += int(keep[start : start + size].sum())
        start += size
    total_weight = sum(s.weight for s in cfg.sources)
    return {
        s.display_name(): {
            "weight": s.weight,
            "documents": docs[s.display_name()],
            "mixture_fraction": s.weight / total_weight,
        }
        for s in cfg.sources
    }


@task(name="ingest", cache_policy=NO_CACHE)
def ingest_task(cfg: IngestConfig, ray_cfg: RayConfig, workspace: str) -> dict[str, Any]:
    """Run ingestion (or reuse a complete output with the same fingerprint); return its summary.

    Caching is lmpipe's fingerprint check inside `run_ingest`, not Prefect's result cache: the
    fingerprint covers the inputs' bytes, which Prefect's input hashing cannot see.
    """
    logger = get_run_logger()
    result = run_ingest(cfg, ray_cfg, Path(workspace), progress=make_reporter(logger))
    counts = result.manifest["counts"]
    logger.info(
        "ingest %s: %s (%s)",
        result.manifest["fingerprint"],
        "reused" if result.reused else "built",
        counts,
    )
    return {
        "stage": STAGE,
        "path": str(result.path),
        "fingerprint": result.manifest["fingerprint"],
        "reused": result.reused,
    }
