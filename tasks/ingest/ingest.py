"""Ingestion: raw corpus files → cleaned, deduplicated, split Arrow shards and a manifest.

The pure core is `prepare_documents` (raw text table → cleaned, filtered, hashed documents).
`process_unit` and `write_shard` are the Ray task bodies; `tasks.ingest.stage` drives them and
`ingest_task` is the Prefect wrapper.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.common import schema
from tasks.common.io import (
    DigestSink,
    arrow_of,
    atomic_writer,
    file_matches,
    numpy_of,
    read_ipc_stream,
    repeat_string,
    write_json_atomic,
)
from tasks.ingest.dedup import (
    HASH_HI,
    HASH_LO,
    MINHASH,
    DedupConfig,
    content_hashes,
    hex_ids,
    minhash_signatures,
)
from tasks.ingest.readers import read_unit
from tasks.ingest.records import RawBatch
from tasks.ingest.sources import SourceConfig, WorkUnit
from tasks.ingest.text import CleanConfig, SentenceConfig, clean_texts, split_sentences

SPLITS = ("train", "validation", "test")
STAGED = ("docs", "bad")  # the staged files of a unit: unit-NNNNNN.{docs,bad}.arrow
# Shards start their writeback every this many bytes, so their closing fsync is short.
_WRITEBACK_BYTES = 16 << 20
log = logging.getLogger(__name__)


class SplitConfig(BaseModel):
    """Document-level split, assigned by the document's content hash (stable as data grows)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    validation: float = Field(0.01, ge=0, lt=1, description="Fraction of documents held out.")
    test: float = Field(0.01, ge=0, lt=1, description="Fraction of documents for the test split.")

    @model_validator(mode="after")
    def _leaves_training_data(self) -> SplitConfig:
        if self.validation + self.test >= 1:
            raise ValueError(f"validation + test = {self.validation + self.test} must be < 1")
        return self


class IngestConfig(BaseModel):
    """Everything the ingestion stage does, from which files to the shard size."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    sources: list[SourceConfig] = Field(min_length=1, description="Inputs of the corpus.")
    clean: CleanConfig = Field(default_factory=CleanConfig)
    sentences: SentenceConfig = Field(default_factory=SentenceConfig)
    min_chars: int = Field(1, ge=0, description="Drop documents shorter than this (characters).")
    max_chars: int = Field(
        1_000_000, ge=1, description="Drop documents longer than this (characters)."
    )
    max_record_bytes: int = Field(
        16 << 20,
        ge=1024,
        description="Quarantine raw records larger than this (bytes); bounds "
        "memory whatever the input.",
    )
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    shard_size_mb: float = Field(
        64, ge=0.001, le=4096, description="Target shard size in MiB of text (and sentences)."
    )
    unit_size_mb: float = Field(
        32, ge=0.001, le=4096, description="Input bytes per parallel work unit."
    )
    incremental: bool = Field(
        True, description="Reuse a previous ingest whose inputs are a subset of these."
    )

    @model_validator(mode="after")
    def _distinct_sources(self) -> IngestConfig:
        names = [source.display_name() for source in self.sources]
        dupes = sorted({name for name in names if names.count(name) > 1})
        if dupes:
            raise ValueError(f"source names must be distinct; repeated: {dupes} (set 'name')")
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars={self.min_chars} exceeds max_chars={self.max_chars}")
        return self


RAW = pa.schema(
    [(schema.OFFSET, pa.int64()), (schema.LINE, pa.int64()), (schema.TEXT, pa.large_string())]
)


def prepare_documents(raw: pa.Table, cfg: IngestConfig) -> tuple[pa.Table, Counter[str]]:
    """Clean, filter, split into sentences and hash raw documents.

    Returns the kept documents (offset, line, text, sentences, hash_hi, hash_lo, and a MinHash
    signature when near dedup is on) and the count of filtered documents per reason.
    """
    schema.require_columns(raw, schema.OFFSET, schema.LINE, schema.TEXT)
    text = clean_texts(raw.column(schema.TEXT).combine_chunks(), cfg.clean)
    length = pc.utf8_length(text)
    reasons = pc.case_when(
        pc.make_struct(
            pc.equal(length, 0), pc.less(length, cfg.min_chars), pc.greater(length, cfg.max_chars)
        ),
        "empty",
        "too_short",
        "too_long",
    )
    filtered: Counter[str] = Counter(
        {r["values"]: r["counts"] for r in pc.value_counts(reasons.drop_null()).to_pylist()}
    )
    keep = pc.is_null(reasons)
    text = pc.filter(text, keep)
    sentences = split_sentences(text, cfg.sentences)
    hi, lo = content_hashes(text)
    columns = {
        schema.OFFSET: pc.filter(raw.column(schema.OFFSET), keep),
        schema.LINE: pc.filter(raw.column(schema.LINE), keep),
        schema.TEXT: text.cast(pa.large_string()),
        schema.SENTENCES: sentences,
        HASH_HI: arrow_of(hi),
        HASH_LO: arrow_of(lo),
    }
    if cfg.dedup.near.enabled:
        columns[MINHASH] = minhash_signatures(text, cfg.dedup.near)
    return pa.table(columns), filtered


@dataclass(frozen=True)
class UnitJob:
    """What one Ray task needs to process one work unit."""

    unit: WorkUnit
    cfg: IngestConfig
    staging: str
    storage: dict[str, str]


def _raw_table(batch: RawBatch) -> pa.Table:
    return pa.table(
        [
            pa.array(batch.offsets, pa.int64()),
            pa.array(batch.lines, pa.int64()),
            pa.array(batch.texts, pa.large_string()),
        ],
        schema=RAW,
    )


def _quarantine_table(batch: RawBatch, unit: WorkUnit) -> pa.Table:
    n = len(batch.bad)
    return pa.table(
        {
            schema.SOURCE: pa.array([unit.file.source] * n, pa.string()),
            schema.SOURCE_FILE: pa.array([unit.file.rel] * n, pa.string()),
            schema.OFFSET: pa.array([r.offset for r in batch.bad], pa.int64()),
            schema.LINE: pa.array([r.line for r in batch.bad], pa.int64()),
            schema.REASON: pa.array([r.reason or "" for r in batch.bad], pa.string()),
            schema.DETAIL: pa.array([r.detail for r in batch.bad], pa.string()),
            schema.EXCERPT: pa.array([r.excerpt for r in batch.bad], pa.binary()),
        },
        schema=schema.QUARANTINE,
    )


def process_unit(job: UnitJob) -> dict[str, Any]:
    """Read, clean, filter and hash one work unit into staging files; return its summary.

    The summary JSON is written last and records the size and xxh3 digest of each staged file,
    so a rerun after a crash reuses a unit whose summary and files still match, and redoes any
    other. That check, not an fsync, is what makes staging safe against a crash of the machine:
    staged files are temporary, and waiting for them to reach the disk cost a core's time.
    """
    unit, cfg = job.unit, job.cfg
    stem = Path(job.staging) / f"unit-{unit.index:06d}"
    summary_path = stem.with_suffix(".json")
    staged = staged_summary(stem)
    if staged is not None:
        return staged
    filtered: Counter[str] = Counter()
    quarantined: Counter[str] = Counter()
    read = kept = newlines = 0
    with (
        atomic_writer(stem.with_suffix(".docs.arrow"), durable=False) as docs_file,
        atomic_writer(stem.with_suffix(".bad.arrow"), durable=False) as bad_file,
    ):
        docs_out, bad_out = DigestSink(docs_file, "xxh3_128"), DigestSink(bad_file, "xxh3_128")
        bad_writer = pa.ipc.new_stream(bad_out, schema.QUARANTINE)
        doc_writer = None
        for batch in read_unit(
            unit, _txt_mode(cfg, unit), _text_field(cfg, unit), cfg.max_record_bytes, job.storage
        ):
            docs, dropped = prepare_documents(_raw_table(batch), cfg)
            if doc_writer is None:
                doc_writer = pa.ipc.new_stream(docs_out, docs.schema)
            doc_writer.write_table(docs)
            bad_writer.write_table(_quarantine_table(batch, unit))
            read += len(batch.texts) + len(batch.bad)
            kept += docs.num_rows
            filtered.update(dropped)
            quarantined.update(r.reason or "" for r in batch.bad)
            newlines = max(newlines, batch.next_line - 1)
        if doc_writer is None:
            empty, _ = prepare_documents(RAW.empty_table(), cfg)
            doc_writer = pa.ipc.new_stream(docs_out, empty.schema)
        doc_writer.close()
        bad_writer.close()
    summary = {
        "index": unit.index,
        "read": read,
        "kept": kept,
        "newlines": newlines,
        "filtered": dict(filtered),
        "quarantined": dict(quarantined),
        "staged": {"docs": docs_out.entry(), "bad": bad_out.entry()},
    }
    write_json_atomic(summary_path, summary, durable=False)
    return summary


def staged_summary(stem: Path) -> dict[str, Any] | None:
    """The summary of a unit staged by an earlier run, or None unless it and its files check out.

    A summary that is missing, unreadable, or whose files differ in size or digest from what it
    recorded (a crash of the machine can lose unsynced writes) means the unit is done again.
    """
    path = stem.with_suffix(".json")
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
        intact = all(
            file_matches(stem.with_suffix(f".{kind}.arrow"), summary["staged"][kind])
            for kind in STAGED
        )
    except (ValueError, KeyError, TypeError):
        intact = False
    if intact:
        return summary  # type: ignore[no-any-return]
    log.warning("staged unit %s does not match its summary; processing it again", stem.name)
    return None


def _source_of(cfg: IngestConfig, unit: WorkUnit) -> SourceConfig:
    return next(s for s in cfg.sources if s.display_name() == unit.file.source)


def _txt_mode(cfg: IngestConfig, unit: WorkUnit) -> str:
    return _source_of(cfg, unit).txt_mode


def _text_field(cfg: IngestConfig, unit: WorkUnit) -> str:
    return _source_of(cfg, unit).text_field


def assign_split(hash_hi: np.ndarray, cfg: SplitConfig) -> np.ndarray:
    """Map each document's content hash to 0 (train), 1 (validation) or 2 (test)."""
    u = hash_hi.astype(np.float64) / 2.0**64
    return np.where(u < cfg.validation, 1, np.where(u < cfg.validation + cfg.test, 2, 0))


@dataclass(frozen=True)
class ShardJob:
    """One output shard: rows (per unit) taken from staging, and where to write them."""

    path: str
    staging: str
    parts: tuple[tuple[int, str, str, int, np.ndarray], ...]  # unit, source, file, line base, rows


def write_shard(job: ShardJob) -> dict[str, Any]:
    """Assemble one shard from staged units and write it atomically; return rows and bytes.

    Each staged part is written as its own record batches as soon as it is taken, so a worker
    holds one part at a time, never the whole shard (or two copies of it). The sha256 is taken
    from the bytes on their way to the file, not by reading the file back.
    """
    rows_written = 0
    with atomic_writer(Path(job.path)) as handle:
        sink = DigestSink(handle, "sha256", writeback_bytes=_WRITEBACK_BYTES)
        with pa.ipc.new_stream(sink, schema.DOCUMENTS) as writer:
            for unit_index, source, file, line_base, rows in job.parts:
                staged = read_ipc_stream(Path(job.staging) / f"unit-{unit_index:06d}.docs.arrow")
                part = staged.take(arrow_of(rows.astype(np.int64, copy=False)))
                n = part.num_rows
                writer.write_table(
                    pa.table(
                        {
                            schema.DOC_ID: hex_ids(
                                numpy_of(part.column(HASH_HI)), numpy_of(part.column(HASH_LO))
                            ),
                            schema.SOURCE: repeat_string(source, n),
                            schema.SOURCE_FILE: repeat_string(file, n),
                            schema.OFFSET: part.column(schema.OFFSET),
                            schema.LINE: pc.add(part.column(schema.LINE), line_base),
                            schema.TEXT: part.column(schema.TEXT),
                            schema.SENTENCES: part.column(schema.SENTENCES),
                        },
                        schema=schema.DOCUMENTS,
                    )
                )
                rows_written += n
                del staged, part  # drop the part (and the map of its unit) before the next one
    return {"rows": rows_written, "bytes": sink.bytes_written, "sha256": sink.hexdigest()}
