"""Readers of structured inputs: JSON arrays (streamed), CSV/TSV, Parquet, saved datasets."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from tasks.ingest.records import DECOMPRESS_ERRORS, EXCERPT, RawBatch, emit, emit_value
from tasks.ingest.sources import RawRecord, WorkUnit, arrow_files, open_stream

_BLOCK = 8 << 20


def _drain(stream: Any, batch: RawBatch, index: int, tail: str | None = None) -> None:
    """Read `stream` to its end, adding a `truncated_compressed` record if it breaks there.

    The reader stops early at the array's `]` or at a bad element; a compressed file cut or
    damaged after that point (its trailer, its CRC) is damaged all the same, and is reported.
    With `tail` (the text after the array's `]`), anything but whitespace after the array is
    quarantined as `malformed_json`, so that no trailing data is dropped unseen.
    """
    extra = (tail or "").strip().encode()[:EXCERPT]
    try:
        while chunk := stream.read(_BLOCK):
            if tail is not None and not extra and chunk.strip():
                extra = chunk.strip()[:EXCERPT]
    except DECOMPRESS_ERRORS as exc:
        batch.add_bad(index, None, "truncated_compressed", str(exc), b"")
        return
    if extra:
        batch.add_bad(index, None, "malformed_json", "data after the top-level array", extra)


@dataclass
class _JsonArray:
    """Where `read_json_array` is: the decoded text not yet parsed, the next element's index."""

    stream: Any
    key: str
    limit: int
    decoder: json.JSONDecoder = field(default_factory=json.JSONDecoder)
    buf: str = ""
    index: int = 0


def read_json_array(
    unit: WorkUnit, key: str, limit: int, opts: dict[str, str]
) -> Iterator[RawBatch]:
    """Stream the elements of a top-level JSON array; `offset` is the element index."""
    # utf-8-sig: a leading BOM is not part of the array (else the whole file is quarantined).
    text_decoder = codecs.getincrementaldecoder("utf-8-sig")()
    started = False
    with open_stream(unit.file, opts) as stream:
        arr = _JsonArray(stream, key, limit)
        while True:
            batch = RawBatch()
            try:
                chunk = stream.read(_BLOCK)
                arr.buf += text_decoder.decode(chunk, final=not chunk)
            except (UnicodeDecodeError, *DECOMPRESS_ERRORS) as exc:
                _read_failed(arr, batch, exc)
                yield batch
                return
            pos = 0
            if not started:
                stripped = arr.buf.lstrip()
                if not stripped and chunk:
                    continue
                if not stripped.startswith("["):
                    _not_an_array(stream, batch, stripped)
                    yield batch
                    return
                started, pos = True, len(arr.buf) - len(stripped) + 1
            rest = _decode_elements(arr, batch, pos, more=bool(chunk))
            if rest is None:  # the array ended, or a bad element stopped the reader
                yield batch
                return
            arr.buf = arr.buf[rest:]
            yield batch
            if not chunk:
                return


def _read_failed(arr: _JsonArray, batch: RawBatch, exc: Exception) -> None:
    """Quarantine what is left of the text after bad UTF-8 or broken compression."""
    reason = "invalid_utf8" if isinstance(exc, UnicodeDecodeError) else "truncated_compressed"
    batch.add_bad(arr.index, None, reason, str(exc), arr.buf.encode()[:EXCERPT])
    if reason == "invalid_utf8":  # the stream itself may break further on
        _drain(arr.stream, batch, arr.index + 1)


def _not_an_array(stream: Any, batch: RawBatch, stripped: str) -> None:
    """Quarantine a file that is empty or does not start with `[`, then drain it."""
    detail = "expected a top-level JSON array" if stripped else "the file has no bytes"
    reason = "malformed_json" if stripped else "empty_file"
    batch.add_bad(0, None, reason, detail, stripped[:EXCERPT].encode())
    _drain(stream, batch, 1)


def _decode_elements(arr: _JsonArray, batch: RawBatch, pos: int, more: bool) -> int | None:
    """Emit the complete elements of `arr.buf` from `pos`; return where the unparsed rest starts.

    An element that may continue in the next block (`more`) waits for it, up to `arr.limit`
    characters. Returns None when the array ended at its `]` or a malformed element stopped
    the reader (the stream is drained in both cases).
    """
    buf, index = arr.buf, arr.index
    try:
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                _drain(arr.stream, batch, index, tail=buf[pos + 1 :])
                return None
            try:
                obj, end = arr.decoder.raw_decode(buf, pos)
            # ValueError: an integer over Python's 4300-digit limit; RecursionError: deep
            # nesting. Both are bad elements, not reader crashes.
            except (ValueError, RecursionError) as exc:
                if more and len(buf) - pos <= arr.limit:
                    return pos  # the element continues in the next block
                excerpt = buf[pos : pos + EXCERPT].encode()
                batch.add_bad(index, None, "malformed_json", str(exc), excerpt)
                _drain(arr.stream, batch, index + 1)
                return None
            excerpt = buf[pos:end].encode()[:EXCERPT]
            emit_value(batch, obj, excerpt, index, None, arr.key, check_surrogates=True)
            index, pos = index + 1, end
    finally:
        arr.index = index


def read_table(unit: WorkUnit, key: str, opts: dict[str, str]) -> Iterator[RawBatch]:
    """Read a text column from a CSV/TSV, Parquet row-group range or saved-dataset file."""
    row = 0
    if unit.file.format == "parquet":  # offsets count rows from the start of the file
        with open_stream(unit.file, opts) as handle:
            meta = pq.ParquetFile(handle).metadata
        row = sum(meta.row_group(g).num_rows for g in range(unit.start))
    for batch_table, bad in _table_batches(unit, key, opts):
        batch = RawBatch(bad=bad)
        column = batch_table.column(key) if batch_table.num_rows else pa.array([], pa.string())
        values = column.to_pylist()
        for value in values:
            if value is None:
                batch.add_bad(row, None, "missing_field", f"column {key!r} is null", b"")
            elif isinstance(value, bytes):
                emit(batch, value, row, None, None, blank_is_record=True)
            elif not isinstance(value, str):  # a Parquet/dataset column of numbers, lists, ...
                kind = column.type
                batch.add_bad(row, None, "wrong_type", f"column {key!r} is {kind}, not text", b"")
            else:
                batch.offsets.append(row)
                batch.lines.append(None)
                batch.texts.append(value)
            row += 1
        yield batch


def _table_batches(
    unit: WorkUnit, key: str, opts: dict[str, str]
) -> Iterator[tuple[pa.Table, list[RawRecord]]]:
    file = unit.file
    if file.format == "parquet":
        with open_stream(file, opts) as handle:
            parquet = pq.ParquetFile(handle)
            groups = list(range(unit.start, unit.end))
            for record_batch in parquet.iter_batches(8192, row_groups=groups, columns=[key]):
                yield pa.Table.from_batches([record_batch]), []
        return
    if file.format == "hf_disk":
        for path in arrow_files(file.uri):
            with pa.memory_map(path) as source:
                for record_batch in ipc.open_stream(source):
                    yield pa.Table.from_batches([record_batch]).select([key]), []
        return
    bad: list[RawRecord] = []

    def on_invalid(row: Any) -> str:
        text = (row.text or "").encode()
        bad.append(
            RawRecord(
                row.number or -1,
                row.number,
                None,
                "malformed_csv",
                f"expected {row.expected_columns} columns, got {row.actual_columns}",
                text[:EXCERPT],
            )
        )
        return "skip"

    parse = pacsv.ParseOptions(
        delimiter="\t" if file.format == "tsv" else ",",
        invalid_row_handler=on_invalid,
        newlines_in_values=True,
    )
    convert = pacsv.ConvertOptions(include_columns=[key], column_types={key: pa.binary()})
    with open_stream(file, opts) as raw:
        stream = _StopAtError(raw)
        try:
            reader = pacsv.open_csv(
                stream,
                read_options=pacsv.ReadOptions(block_size=_BLOCK),
                parse_options=parse,
                convert_options=convert,
            )
            for record_batch in reader:
                table = pa.Table.from_batches([record_batch])
                yield table, bad[:]
                bad.clear()
        except pa.ArrowInvalid as exc:  # e.g. a row larger than a block: the rest is unreadable
            bad.append(RawRecord(-1, None, None, "malformed_csv", str(exc)[:EXCERPT]))
    if stream.error is not None:  # every row decoded before the break was parsed above
        error = stream.error
        reason = "truncated_compressed" if isinstance(error, EOFError) else "corrupt_compressed"
        bad.append(RawRecord(-1, None, None, reason, f"{type(error).__name__}: {error}"))
    if bad:
        yield pa.table({key: pa.array([], pa.binary())}), bad


class _StopAtError:
    """A byte stream that ends, instead of raising, at a decompression error, and keeps it.

    pyarrow's CSV reader drops the block it is reading when `read` raises; ending the stream
    there lets it parse every row decoded before the break.
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.error: BaseException | None = None
        self.closed = False

    def read(self, size: int = -1) -> bytes:
        """Read up to `size` bytes; b"" from the first decompression error on."""
        if self.error is not None:
            return b""
        try:
            return bytes(self._raw.read(size))
        except DECOMPRESS_ERRORS as exc:
            self.error = exc
            return b""

    def readable(self) -> bool:
        """Return True: the stream is read-only."""
        return True

    def close(self) -> None:
        """Mark the stream closed; the caller closes the file underneath."""
        self.closed = True
