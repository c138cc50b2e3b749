"""Corpus encoding: ingested documents → token ids per sentence, with statistics.

The core (`encode_documents`) is pure: a table of documents and a tokenizer in, a table of ids
out. `encode_shard` is the Ray task body: one ingest shard in, one token shard out, streamed in
batches, written atomically, with its statistics staged beside it so a rerun skips it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from tasks.common import schema
from tasks.common.io import atomic_writer, read_ipc_stream, sha256_file, write_json_atomic
from tasks.tokenizer.bytelevel import SegmentEncoder

#: Left edges of the tokens-per-document histogram: 0, then quarter octaves up to 2**24.
HISTOGRAM_EDGES = np.unique(np.round(2 ** (np.arange(0, 97) / 4)).astype(np.int64))
HISTOGRAM_EDGES = np.concatenate([[0], HISTOGRAM_EDGES])


class EncodeConfig(BaseModel):
    """How the corpus is encoded into token shards."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    batch_documents: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Documents per `encode_batch` call and per record batch written.",
    )
    shard_documents: int = Field(
        4096,
        ge=1,
        description="Documents per token shard, and per Ray task: an ingest shard is cut "
        "into parts of this size so that every worker has work.",
    )
    fast_ascii: bool = Field(
        True,
        description="Byte-level BPE only: split ASCII sentences with lmpipe's exact copy of the "
        "GPT-2 pattern and encode each distinct word once (same ids; the stage ran 2.3-2.5x "
        "faster on English text); false: `tokenizers` encodes every sentence.",
    )
    dtype: Literal["auto", "uint16", "uint32"] = Field(
        "auto", description="Id type of the shards; auto: uint16 when the vocabulary fits."
    )


def id_type(vocab_size: int, cfg: EncodeConfig) -> pa.DataType:
    """The Arrow id type for a vocabulary of `vocab_size` (uint16 up to 65,536 ids).

    Raises:
        ValueError: `dtype: uint16` was asked for a vocabulary that does not fit.
    """
    fits = vocab_size <= 1 << 16
    if cfg.dtype == "uint16" and not fits:
        raise ValueError(f"encode.dtype=uint16 cannot hold a vocabulary of {vocab_size:,} ids")
    if cfg.dtype == "uint32" or not fits:
        return pa.uint32()
    return pa.uint16()


class SentenceMismatchError(ValueError):
    """A document's sentences are not cut from its text (a plug-in splitter rewrote them)."""


def sentence_segments(
    doc_ids: list[str], texts: list[str], sentences: list[list[str]]
) -> tuple[list[str], np.ndarray]:
    """Cut each text into one segment per sentence: the sentence plus the whitespace before it.

    The segments of a document concatenate back to its text exactly. Returns the segments of
    all documents in order and the number of segments of each document.

    Raises:
        SentenceMismatchError: a sentence is not found, in order, in its document's text.
    """
    segments: list[str] = []
    counts = np.empty(len(texts), dtype=np.int64)
    for row, (text, sents) in enumerate(zip(texts, sentences, strict=True)):
        pos = 0
        for k, sentence in enumerate(sents):
            at = text.find(sentence, pos)
            if at < 0:
                raise SentenceMismatchError(
                    f"document {doc_ids[row]}: sentence {k} ({sentence[:60]!r}) is not in its "
                    "text after the previous one; the encoder needs sentences cut from the text"
                )
            segments.append(text[pos : at + len(sentence)])
            pos = at + len(sentence)
        if pos < len(text):  # trailing text the splitter left out stays with the document
            if sents:
                segments[-1] += text[pos:]
            else:
                segments.append(text)
        counts[row] = len(sents) or (1 if text else 0)
    return segments, counts


def encode_documents(
    table: pa.Table, tok: Tokenizer | SegmentEncoder, ids: pa.DataType
) -> pa.Table:
    """Encode each document sentence by sentence (no special tokens); returns `tokens_schema`.

    A `SegmentEncoder` gives the same ids as its tokenizer, faster for byte-level BPE; pass one
    to keep its word cache across calls.
    """
    schema.require_columns(table, schema.DOC_ID, schema.TEXT, schema.SENTENCES)
    doc_ids = table.column(schema.DOC_ID).to_pylist()
    segments, counts = sentence_segments(
        doc_ids, table.column(schema.TEXT).to_pylist(), table.column(schema.SENTENCES).to_pylist()
    )
    encoder = tok if isinstance(tok, SegmentEncoder) else SegmentEncoder(tok)
    flat, lengths = encoder.encode(segments)
    sentence_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    doc_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    values = pa.array(flat.astype(ids.to_pandas_dtype()), ids)
    per_sentence = pa.ListArray.from_arrays(pa.array(sentence_offsets), values)
    return pa.table(
        {
            schema.DOC_ID: pa.array(doc_ids, pa.string()),
            schema.NUM_TOKENS: pa.array(np.diff(sentence_offsets[doc_offsets]), pa.int32()),
            schema.TOKEN_IDS: pa.ListArray.from_arrays(pa.array(doc_offsets), per_sentence),
        },
        schema=schema.tokens_schema(ids),
    )


def encode_stats(docs: pa.Table, encoded: pa.Table, unk_id: int | None) -> dict[str, Any]:
    """Counts of one encoded batch: documents, sentences, tokens, characters, unknown tokens.

    `histogram` counts documents per `HISTOGRAM_EDGES` bin of their token count.
    """
    tokens = encoded.column(schema.NUM_TOKENS).to_numpy()
    token_ids = encoded.column(schema.TOKEN_IDS)
    sentences = pc.list_flatten(token_ids)
    flat = pc.list_flatten(sentences).to_numpy()
    unknown = np.flatnonzero(flat == unk_id) if unk_id is not None else np.empty(0, np.int64)
    with_unknown = 0
    if len(unknown):
        sentence_of_token = pc.list_parent_indices(sentences).to_numpy()
        doc_of_sentence = pc.list_parent_indices(token_ids).to_numpy()
        with_unknown = len(np.unique(doc_of_sentence[sentence_of_token[unknown]]))
    histogram = np.bincount(
        np.searchsorted(HISTOGRAM_EDGES, tokens, side="right") - 1, minlength=len(HISTOGRAM_EDGES)
    )
    return {
        "documents": encoded.num_rows,
        "sentences": len(sentences),
        "tokens": int(tokens.sum()),
        "characters": int(pc.sum(pc.utf8_length(docs.column(schema.TEXT))).as_py() or 0),
        "unknown_tokens": len(unknown),
        "documents_with_unknown": with_unknown,
        "max_tokens_per_document": int(tokens.max(initial=0)),
        "histogram": histogram.tolist(),
    }


def merge_stats(total: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """Add the counts of `part` to `total` (histograms bin by bin, maxima by max)."""
    if not total:
        return dict(part)
    merged = {
        k: total[k] + part[k] for k in total if k not in ("histogram", "max_tokens_per_document")
    }
    merged["max_tokens_per_document"] = max(
        total["max_tokens_per_document"], part["max_tokens_per_document"]
    )
    merged["histogram"] = [
        a + b for a, b in zip(total["histogram"], part["histogram"], strict=True)
    ]
    return merged


@dataclass(frozen=True)
class EncodeJob:
    """Rows `[start, stop)` of one ingest shard, to encode into one token shard."""

    src: str
    start: int
    stop: int
    dst: str
    stats: str
    tokenizer: str
    ids: str
    unk_id: int | None
    cfg: EncodeConfig


@lru_cache(maxsize=2)
def _load_encoder(path: str, fast: bool) -> SegmentEncoder:
    # once per worker process, not per shard, so that the word cache carries over
    return SegmentEncoder(Tokenizer.from_file(path), fast=fast)


def encode_shard(job: EncodeJob) -> dict[str, Any]:
    """Encode rows of one ingest shard into a token shard; return its statistics and file entry.

    The rows are read by memory map and encoded `batch_documents` at a time, each batch written
    as it is done. The statistics JSON is written last, so a shard with statistics is complete
    and a rerun after a crash skips it.
    """
    stats_path, dst = Path(job.stats), Path(job.dst)
    if stats_path.exists() and dst.exists():
        return json.loads(stats_path.read_text())  # type: ignore[no-any-return]
    tok = _load_encoder(job.tokenizer, job.cfg.fast_ascii)
    ids = pa.uint16() if job.ids == "uint16" else pa.uint32()
    docs = read_ipc_stream(Path(job.src), [schema.DOC_ID, schema.TEXT, schema.SENTENCES])
    docs = docs.slice(job.start, job.stop - job.start)
    stats: dict[str, Any] = {}
    with atomic_writer(dst) as handle, pa.ipc.new_stream(handle, schema.tokens_schema(ids)) as out:
        for start in range(0, docs.num_rows, job.cfg.batch_documents):
            part = docs.slice(start, job.cfg.batch_documents)
            encoded = encode_documents(part, tok, ids)
            out.write_table(encoded)
            stats = merge_stats(stats, encode_stats(part, encoded, job.unk_id))
    if not stats:
        stats = encode_stats(docs, encode_documents(docs, tok, ids), job.unk_id)
    stats |= {"bytes": dst.stat().st_size, "sha256": sha256_file(dst)}
    write_json_atomic(stats_path, stats)
    return stats
