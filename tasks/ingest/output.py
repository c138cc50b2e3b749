"""Ingestion's reduce side: dedup keys, the shard plan, quarantine, index, counts, mixture.

Everything here runs in the driver after the units are staged, and works on small per-document
keys (hashes, sizes) or streams staged files unit by unit; it never holds document text.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.common import schema
from tasks.common.io import (
    arrow_of,
    atomic_writer,
    flatten,
    numpy_of,
    read_ipc_stream,
    safe_join,
    sha256_file,
    write_ipc_stream,
)
from tasks.ingest.dedup import (
    HASH_HI,
    HASH_LO,
    MINHASH,
    DedupConfig,
    exact_keep_mask,
    near_keep_mask,
)
from tasks.ingest.ingest import SPLITS, IngestConfig, ShardJob, assign_split
from tasks.ingest.sources import WorkUnit


@dataclass(frozen=True)
class Keys:
    """Per-document keys of all staged units, in global (file, offset) order."""

    hi: np.ndarray  # (N,) uint64: high half of the content hash
    lo: np.ndarray  # (N,) uint64: low half
    text_bytes: np.ndarray  # (N,) int64: UTF-8 bytes of each text
    sizes: list[int]  # documents per unit
    signatures: pa.Array | None  # (N,) fixed_size_list<uint32>[num_perm], near dedup only


def load_keys(staging: Path, units: list[WorkUnit], near: bool) -> Keys:
    """Read the hash, length (and signature) columns of every staged unit, memory-mapped."""
    cols = [HASH_HI, HASH_LO, schema.TEXT] + ([MINHASH] if near else [])
    tables = [read_ipc_stream(staging / f"unit-{u.index:06d}.docs.arrow", cols) for u in units]

    def concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(arrays) if arrays else np.empty(0, dtype)

    return Keys(
        hi=concat([numpy_of(t.column(HASH_HI)) for t in tables], np.uint64),
        lo=concat([numpy_of(t.column(HASH_LO)) for t in tables], np.uint64),
        text_bytes=concat(
            [numpy_of(pc.binary_length(t.column(schema.TEXT))) for t in tables], np.int64
        ),
        sizes=[t.num_rows for t in tables],
        signatures=(
            pa.concat_arrays([t.column(MINHASH).combine_chunks() for t in tables])
            if near and tables
            else None
        ),
    )


@dataclass(frozen=True)
class DedupResult:
    """Which documents survive, and how many each kind of dedup removed."""

    keep: np.ndarray  # (N,) bool
    exact: int
    near: int


def dedup_documents(keys: Keys, cfg: DedupConfig, prior: pa.Table | None) -> DedupResult:
    """Apply exact then near dedup against each other and an earlier ingest's index."""
    n = len(keys.hi)
    keep = np.ones(n, dtype=bool)
    if cfg.exact:
        keep = exact_keep_mask(
            keys.hi,
            keys.lo,
            numpy_of(prior.column(HASH_HI)) if prior else None,
            numpy_of(prior.column(HASH_LO)) if prior else None,
        )
    exact = int((~keep).sum())
    if cfg.near.enabled and keys.signatures is not None:
        perm = cfg.near.num_perm
        signatures = keys.signatures.values.to_numpy().reshape(-1, perm)
        prior_sig = np.empty((0, perm), np.uint32)
        if prior is not None and MINHASH in prior.column_names:
            prior_sig = prior.column(MINHASH).combine_chunks().values.to_numpy().reshape(-1, perm)
        survivors = np.flatnonzero(keep)
        near = near_keep_mask((signatures[i] for i in survivors), cfg.near, iter(prior_sig))
        keep[survivors[~np.array(near, dtype=bool)]] = False
    return DedupResult(keep, exact, int(n - exact - keep.sum()))


def write_dedup_index(
    out: Path, keys: Keys, keep: np.ndarray, prior: pa.Table | None
) -> dict[str, Any]:
    """Write the hashes (and signatures) of every kept document, old ones first."""
    columns = {HASH_HI: arrow_of(keys.hi[keep]), HASH_LO: arrow_of(keys.lo[keep])}
    if keys.signatures is not None:
        columns[MINHASH] = keys.signatures.filter(pa.array(keep))
    index = pa.table(columns)
    if prior is not None:
        index = pa.concat_tables([prior, index])
    path = out / "dedup_index.arrow"
    write_ipc_stream(index, path)
    return {
        "name": path.name,
        "rows": index.num_rows,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def shard_jobs(
    out: Path,
    units: list[WorkUnit],
    summaries: list[dict[str, Any]],
    keys: Keys,
    keep: np.ndarray,
    cfg: IngestConfig,
    generation: int,
) -> tuple[list[ShardJob], list[tuple[str, str]]]:
    """Cut the kept documents, in key order, into shards of about `shard_size_mb` per split.

    A document's split follows from its content hash (`assign_split` under `cfg.split`).
    """
    split_of = assign_split(keys.hi, cfg.split)
    target = cfg.shard_size_mb * (1 << 20)
    line_base = line_bases(units, summaries)
    starts = np.concatenate([[0], np.cumsum(keys.sizes)]).astype(np.int64)
    text_bytes = keys.text_bytes
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


def split_entries(
    out: Path,
    base: dict[str, Any] | None,
    names: list[tuple[str, str]],
    written: list[dict[str, Any]],
) -> dict[str, Any]:
    """List each split's shards: an extended ingest's (linked in) first, then the new ones."""
    splits: dict[str, Any] = {s: {"rows": 0, "shards": []} for s in SPLITS}
    if base:
        for split, entry in base["splits"].items():
            for shard in entry["shards"]:
                link_file(
                    safe_join(Path(base["path"]), shard["name"]), safe_join(out, shard["name"])
                )
                splits[split]["shards"].append(shard)
                splits[split]["rows"] += shard["rows"]
    for (split, name), info in zip(names, written, strict=True):
        splits[split]["shards"].append({"name": name, **info})
        splits[split]["rows"] += info["rows"]
    return splits


def link_file(src: Path, dst: Path) -> None:
    """Hard-link an old shard into the new output (copy across file systems), atomically."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


# Characters JSON allows unescaped but that `str.splitlines()` (and many viewers) take for line
# breaks: escaped, so that one quarantined record is always one line of quarantine.jsonl.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _jsonl_line(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, sort_keys=True).translate(_LINE_BREAKS) + "\n"


def line_bases(units: list[WorkUnit], summaries: list[dict[str, Any]]) -> list[int]:
    """Per unit, how many lines of its file come before it (a unit counts its lines from 1)."""
    bases: list[int] = []
    seen: Counter[str] = Counter()
    for unit, summary in zip(units, summaries, strict=True):
        bases.append(seen[unit.file.uri])
        seen[unit.file.uri] += summary["newlines"]
    return bases


def write_quarantine(
    out: Path,
    units: list[WorkUnit],
    summaries: list[dict[str, Any]],
    base: dict[str, Any] | None,
) -> dict[str, Any]:
    """Merge per-unit quarantine records, in unit order, into `quarantine.jsonl`.

    Line numbers become the file's (a unit numbers its lines from its own start), so each
    record names the file and line a person opens.
    """
    line_base = line_bases(units, summaries)
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
                if record[schema.LINE] is not None:
                    record[schema.LINE] += line_base[unit.index]
                handle.write(_jsonl_line(record))
                rows += 1
    path = out / "quarantine.jsonl"
    return {
        "name": path.name,
        "rows": rows,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def reconcile_counts(
    summaries: list[dict[str, Any]], base: dict[str, Any] | None, dedup: DedupResult
) -> dict[str, Any]:
    """Add up the units' counts (and an extended ingest's); fail if they do not reconcile."""
    kept, exact, near = int(dedup.keep.sum()), dedup.exact, dedup.near
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


def mixture(
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


def ingest_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """Turn an ingest manifest's counts, sizes and timing into flat numeric metrics."""
    counts = manifest["counts"]
    metrics: dict[str, float] = {
        k: float(v) for k, v in flatten(counts).items() if isinstance(v, int | float)
    }
    metrics["filtered_total"] = float(sum(counts["filtered"].values()))
    metrics["duplicates_total"] = float(sum(counts["duplicates"].values()))
    metrics["quarantined_total"] = float(sum(counts["quarantined"].values()))
    shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    metrics["shards"] = float(len(shards))
    metrics["output_bytes"] = float(sum(s["bytes"] for s in shards))
    metrics["input_bytes"] = float(sum(i["size"] for i in manifest["inputs"]))
    if manifest.get("elapsed_s"):
        metrics["elapsed_s"] = float(manifest["elapsed_s"])
        metrics["throughput_mb_s"] = metrics["input_bytes"] / 2**20 / manifest["elapsed_s"]
    return metrics
