"""Work-unit planning and streaming readers: input bytes in, column batches of raw text out.

Readers never raise on bad data. Each bad record is returned with its location and a reason, so
that the stage can count and quarantine it; memory is bounded by the read block plus
`max_record_bytes`, whatever the size of the file or of a single line in it.
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import zstandard

from tasks.sources import InputFile, RawRecord, WorkUnit, arrow_files, looks_binary, open_stream

_BLOCK = 8 << 20
_EXCERPT = 256
_SEPARATORS = {
    "line": re.compile(rb"\n"),
    "block": re.compile(rb"\n(?:[ \t\r\f\v]*\n)+"),
}
_DECOMPRESS_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError, ValueError)


@dataclass
class RawBatch:
    """Records read from one block of a unit: good ones as columns, bad ones as `RawRecord`s."""

    offsets: list[int] = field(default_factory=list)
    lines: list[int | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    bad: list[RawRecord] = field(default_factory=list)
    next_line: int = 1  # line number after the last byte read so far (line-based inputs)

    def add_bad(self, offset: int, line: int | None, reason: str, detail: str, raw: bytes) -> None:
        """Record one quarantined record with a bounded excerpt of its bytes."""
        self.bad.append(RawRecord(offset, line, None, reason, detail, raw[:_EXCERPT]))


def _delimiter(file: InputFile, txt_mode: str) -> re.Pattern[bytes] | None:
    if file.format == "jsonl":
        return _SEPARATORS["line"]
    if file.format == "txt" and txt_mode in _SEPARATORS:
        return _SEPARATORS[txt_mode]
    return None


def plan_units(
    files: list[InputFile], txt_mode: str, unit_bytes: int, storage: dict[str, dict[str, str]]
) -> list[WorkUnit]:
    """Cut files into work units; byte ranges of plain text files start exactly at a record."""
    units: list[WorkUnit] = []
    for file in files:
        opts = storage[file.source]
        binary = False
        if file.format in ("txt", "jsonl", "json", "csv", "tsv"):
            with open_stream(file, opts) as stream:
                head, _ = _read_block(stream, 8192)  # a truncation is reported by the reader
            binary = looks_binary(head)
        sep = _delimiter(file, txt_mode)
        if binary or sep is None or file.compression or file.size <= unit_bytes:
            ranges = _tabular_ranges(file, unit_bytes, opts) if not binary else [(0, -1)]
        else:
            ranges = _byte_ranges(file, sep, unit_bytes, opts)
        for start, end in ranges:
            units.append(WorkUnit(len(units), file, start, end, binary))
    return units


def _tabular_ranges(
    file: InputFile, unit_bytes: int, opts: dict[str, str]
) -> list[tuple[int, int]]:
    if file.format != "parquet":
        return [(0, -1)]
    with open_stream(file, opts) as handle:
        meta = pq.ParquetFile(handle).metadata
    ranges, first, size = [], 0, 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        if size >= unit_bytes:
            ranges.append((first, group + 1))
            first, size = group + 1, 0
    if first < meta.num_row_groups or not ranges:
        ranges.append((first, meta.num_row_groups))
    return ranges


def _byte_ranges(
    file: InputFile, sep: re.Pattern[bytes], unit_bytes: int, opts: dict[str, str]
) -> list[tuple[int, int]]:
    bounds = [0]
    with open_stream(file, opts) as stream:
        target = unit_bytes
        while target < file.size:
            start = _next_record_start(stream, target, sep)
            if start is None or start >= file.size:
                break
            bounds.append(start)
            target = start + unit_bytes
    bounds.append(file.size)
    return list(itertools.pairwise(bounds))


def _next_record_start(stream: IO[bytes], pos: int, sep: re.Pattern[bytes]) -> int | None:
    """Return the first record start at or after `pos` (just after a separator), or None."""
    back = 1 if sep.pattern == rb"\n" else 0
    stream.seek(pos - back)
    carry, base = b"", pos - back
    while chunk := stream.read(1 << 20):
        data = carry + chunk
        match = sep.search(data)
        if match and match.end() < len(data):  # a separator cut at the chunk end may grow
            return base + match.end()
        keep = len(data) - 4096 if len(data) > 4096 else 0
        carry, base = data[keep:], base + keep
    return None


def read_unit(
    unit: WorkUnit, txt_mode: str, text_field: str, max_record_bytes: int, opts: dict[str, str]
) -> Iterator[RawBatch]:
    """Yield the records of `unit` in file order, one batch per read block."""
    file = unit.file
    if unit.binary:
        batch = RawBatch()
        batch.add_bad(0, None, "binary_file", "file looks binary (NUL or control bytes)", b"")
        yield batch
        return
    if file.format in ("parquet", "hf_disk", "csv", "tsv"):
        yield from _read_table(unit, text_field, opts)
        return
    if file.format == "json":
        yield from _read_json_array(unit, text_field, max_record_bytes, opts)
        return
    sep = _delimiter(file, txt_mode)
    is_json = file.format == "jsonl"
    with open_stream(file, opts) as stream:
        if unit.start:
            stream.seek(unit.start)
        yield from _read_delimited(
            stream, unit, sep, max_record_bytes, text_field if is_json else None
        )


@dataclass
class _Oversize:
    """A record over `max_record_bytes` that the reader is skipping to its end."""

    offset: int
    line: int
    size: int
    excerpt: bytes


def _read_block(stream: IO[bytes], want: int) -> tuple[bytes, BaseException | None]:
    """Read up to `want` bytes in 1 MiB pieces; on a decompression error return what was read.

    Reading in pieces matters for compressed input: an error inside one large `read()` would
    lose everything that call had decompressed.
    """
    parts: list[bytes] = []
    got = 0
    while got < want:
        try:
            piece = stream.read(min(1 << 20, want - got))
        except _DECOMPRESS_ERRORS as exc:
            return b"".join(parts), exc
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    return b"".join(parts), None


def _read_delimited(
    stream: IO[bytes],
    unit: WorkUnit,
    sep: re.Pattern[bytes] | None,
    limit: int,
    json_field: str | None,
) -> Iterator[RawBatch]:
    """Split a byte stream into records at `sep` (None: the whole unit is one record).

    `base` is the absolute offset of `buf[0]`; `line` the line number at `buf[0]`. A record
    longer than `limit` is skipped to its end, keeping only its start and a small tail.
    """
    remaining = unit.end - unit.start if unit.end >= 0 else -1
    buf, base, line, total = b"", unit.start, 1, 0
    big: _Oversize | None = None
    while True:
        batch = RawBatch()
        want = _BLOCK if remaining < 0 else min(_BLOCK, remaining - total)
        chunk, error = _read_block(stream, want) if want > 0 else (b"", None)
        total += len(chunk)
        eof = error is not None or not chunk or (remaining >= 0 and total >= remaining)
        if total == 0 and eof and error is None and unit.start == 0:
            batch.add_bad(0, None, "empty_file", "the file has no bytes", b"")
            yield batch
            return
        data, pos = buf + chunk, 0
        if big is not None:  # skip an oversize record up to its end
            match = sep.search(data) if sep else None
            if match is None and not eof:
                keep = max(len(data) - 4096, 0)
                big.size += keep
                line += data.count(b"\n", 0, keep)
                base, buf = base + keep, data[keep:]
                batch.next_line = line
                yield batch
                continue
            stop, pos = (match.start(), match.end()) if match else (len(data), len(data))
            detail = f"record of {big.size + stop} bytes exceeds max_record_bytes={limit}"
            batch.add_bad(big.offset, big.line, "record_too_large", detail, big.excerpt)
            line += data.count(b"\n", 0, pos)
            big = None
        if sep is not None:
            for match in sep.finditer(data, pos):
                if not eof and match.end() == len(data):
                    break  # the separator may continue in the next block
                _emit_bounded(batch, data[pos : match.start()], base + pos, line, json_field, limit)
                line += data.count(b"\n", pos, match.end())
                pos = match.end()
        rest = data[pos:]
        if eof:
            if error is None:
                _emit_bounded(batch, rest, base + pos, line, json_field, limit)
            else:  # the partial record at the break, and the fact of the break, are kept
                reason = (
                    "truncated_compressed" if isinstance(error, EOFError) else "corrupt_compressed"
                )
                batch.add_bad(base + pos, line, reason, f"{type(error).__name__}: {error}", rest)
            batch.next_line = line
            yield batch
            return
        if len(rest) > limit:
            keep = len(rest) - 4096
            big = _Oversize(base + pos, line, keep, rest[:_EXCERPT])
            line += rest.count(b"\n", 0, keep)
            base, buf = base + pos + keep, rest[keep:]
        else:
            base, buf = base + pos, rest
        batch.next_line = line
        yield batch


def _emit_bounded(
    batch: RawBatch, raw: bytes, offset: int, line: int, json_field: str | None, limit: int
) -> None:
    if len(raw) > limit:
        detail = f"record of {len(raw)} bytes exceeds max_record_bytes={limit}"
        batch.add_bad(offset, line, "record_too_large", detail, raw)
    else:
        _emit(batch, raw, offset, line, json_field)


def _emit(
    batch: RawBatch,
    raw: bytes,
    offset: int,
    line: int | None,
    json_field: str | None,
    *,
    blank_is_record: bool = False,
) -> None:
    if not blank_is_record and not raw.strip():
        return  # blank lines separate records in text files; they are not records
    if offset == 0 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[3:]
    if b"\x00" in raw:
        batch.add_bad(offset, line, "nul_byte", f"NUL byte at +{raw.index(0)}", raw)
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        batch.add_bad(offset, line, "invalid_utf8", f"invalid UTF-8 at +{exc.start}", raw)
        return
    if json_field is not None:
        _emit_json(batch, text, raw, offset, line, json_field)
        return
    batch.offsets.append(offset)
    batch.lines.append(line)
    batch.texts.append(text)


def _emit_json(
    batch: RawBatch, text: str, raw: bytes, offset: int, line: int | None, key: str
) -> None:
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        batch.add_bad(offset, line, "malformed_json", str(exc), raw)
        return
    _emit_value(batch, obj, raw, offset, line, key)


def _emit_value(
    batch: RawBatch, obj: Any, raw: bytes, offset: int, line: int | None, key: str
) -> None:
    if not isinstance(obj, dict) or key not in obj or obj[key] is None:
        what = "not a JSON object" if not isinstance(obj, dict) else f"no field {key!r}"
        batch.add_bad(offset, line, "missing_field", what, raw)
    elif not isinstance(obj[key], str):
        kind = type(obj[key]).__name__
        batch.add_bad(offset, line, "wrong_type", f"field {key!r} is {kind}, not str", raw)
    else:
        batch.offsets.append(offset)
        batch.lines.append(line)
        batch.texts.append(obj[key])


def _read_json_array(
    unit: WorkUnit, key: str, limit: int, opts: dict[str, str]
) -> Iterator[RawBatch]:
    """Stream the elements of a top-level JSON array; `offset` is the element index."""
    decoder, text_decoder = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    buf, index, started = "", 0, False
    with open_stream(unit.file, opts) as stream:
        while True:
            batch = RawBatch()
            try:
                chunk = stream.read(_BLOCK)
                buf += text_decoder.decode(chunk, final=not chunk)
            except (UnicodeDecodeError, *_DECOMPRESS_ERRORS) as exc:
                reason = (
                    "invalid_utf8"
                    if isinstance(exc, UnicodeDecodeError)
                    else "truncated_compressed"
                )
                batch.add_bad(index, None, reason, str(exc), buf.encode()[:_EXCERPT])
                yield batch
                return
            pos = 0
            if not started:
                stripped = buf.lstrip()
                if not stripped and chunk:
                    continue
                if not stripped.startswith("["):
                    detail = (
                        "expected a top-level JSON array" if stripped else "the file has no bytes"
                    )
                    reason = "malformed_json" if stripped else "empty_file"
                    batch.add_bad(0, None, reason, detail, stripped[:_EXCERPT].encode())
                    yield batch
                    return
                started, pos = True, len(buf) - len(stripped) + 1
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) and buf[pos] == "]":
                    yield batch
                    return
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as exc:
                    if chunk and len(buf) - pos <= limit:
                        break  # the element continues in the next block
                    batch.add_bad(
                        index, None, "malformed_json", str(exc), buf[pos : pos + _EXCERPT].encode()
                    )
                    yield batch
                    return
                _emit_value(batch, obj, buf[pos:end].encode()[:_EXCERPT], index, None, key)
                index, pos = index + 1, end
            buf = buf[pos:]
            yield batch
            if not chunk:
                return


def _read_table(unit: WorkUnit, key: str, opts: dict[str, str]) -> Iterator[RawBatch]:
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
                _emit(batch, value, row, None, None, blank_is_record=True)
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
        import pyarrow.ipc as ipc

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
                text[:_EXCERPT],
            )
        )
        return "skip"

    parse = pacsv.ParseOptions(
        delimiter="\t" if file.format == "tsv" else ",",
        invalid_row_handler=on_invalid,
        newlines_in_values=True,
    )
    convert = pacsv.ConvertOptions(include_columns=[key], column_types={key: pa.binary()})
    with open_stream(file, opts) as handle:
        reader = pacsv.open_csv(
            handle,
            read_options=pacsv.ReadOptions(block_size=_BLOCK),
            parse_options=parse,
            convert_options=convert,
        )
        for record_batch in reader:
            table = pa.Table.from_batches([record_batch])
            yield table, bad[:]
            bad.clear()
    if bad:
        yield pa.table({key: pa.array([], pa.binary())}), bad
