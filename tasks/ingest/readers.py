"""Work-unit planning and streaming readers: input bytes in, column batches of raw text out.

Readers never raise on bad data. Each bad record is returned with its location and a reason, so
that the stage can count and quarantine it; memory is bounded by the read block plus
`max_record_bytes`, whatever the size of the file or of a single line in it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import orjson
import pyarrow.parquet as pq

from tasks.ingest.readers_structured import read_json_array, read_table
from tasks.ingest.records import EXCERPT, RawBatch, emit_bounded, read_block
from tasks.ingest.sources import InputFile, WorkUnit, looks_binary, open_stream

_BLOCK = 8 << 20
_SEPARATORS = {
    "line": re.compile(rb"\n"),
    "block": re.compile(rb"\n(?:[ \t\r\f\v]*\n)+"),
}


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
                head, _ = read_block(stream, 8192)  # a truncation is reported by the reader
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
        yield from read_table(unit, text_field, opts)
        return
    if file.format == "json":
        yield from read_json_array(unit, text_field, max_record_bytes, opts)
        return
    sep = _delimiter(file, txt_mode)
    is_json = file.format == "jsonl"
    with open_stream(file, opts) as stream:
        if unit.start:
            stream.seek(unit.start)
        yield from _read_delimited(
            stream, unit, sep, max_record_bytes, text_field if is_json else None
        )


def _emit_lines(cur: _Cursor, batch: RawBatch, data: bytes, pos: int, eof: bool) -> tuple[int, int]:
    """Emit the complete lines of `data[pos:]`; return the position and line number after them.

    `data` starts at `cur.base` and `data[pos]` is on line `cur.line`; `cur` is not changed.
    The same records as splitting at each newline match, in one `bytes.split` (a line ending the
    block stays for the next one, as with the general separators). For JSON Lines, a line that
    orjson parses into an object holding a string at `cur.json_field` is emitted at once: orjson
    refuses blank lines, NUL bytes, invalid UTF-8 and a byte-order mark, so such a line passes
    every check of `emit` too. Every other line goes through `emit_bounded`'s checks, which
    find its reason; the first line of a file always does (a byte-order mark is stripped there).
    """
    line, json_field, limit = cur.line, cur.json_field, cur.limit
    last = data.rfind(b"\n", pos, len(data) if eof else len(data) - 1)
    if last < 0:
        return pos, line
    offset = cur.base + pos
    fast = json_field is not None
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    for raw in data[pos:last].split(b"\n"):
        if fast and offset and len(raw) <= limit:
            try:
                obj = loads(raw)
            except decode_error:
                obj = None
            value = obj.get(json_field) if type(obj) is dict else None
            if type(value) is str:
                batch.offsets.append(offset)
                batch.lines.append(line)
                batch.texts.append(value)
                offset, line = offset + len(raw) + 1, line + 1
                continue
        emit_bounded(batch, raw, offset, line, json_field, limit)
        offset, line = offset + len(raw) + 1, line + 1
    return last + 1, line


@dataclass
class _Oversize:
    """A record over `max_record_bytes` that the reader is skipping to its end."""

    offset: int
    line: int
    size: int
    excerpt: bytes


@dataclass
class _Cursor:
    """Where `_read_delimited` is: the bytes carried to the next block and their position.

    `base` is the absolute offset of `buf[0]`; `line` the line number at `buf[0]`; `big` the
    oversize record being skipped, if any.
    """

    sep: re.Pattern[bytes] | None
    limit: int
    json_field: str | None
    buf: bytes
    base: int
    line: int = 1
    big: _Oversize | None = None


def _read_delimited(
    stream: IO[bytes],
    unit: WorkUnit,
    sep: re.Pattern[bytes] | None,
    limit: int,
    json_field: str | None,
) -> Iterator[RawBatch]:
    """Split a byte stream into records at `sep` (None: the whole unit is one record).

    A record longer than `limit` is skipped to its end, keeping only its start and a small tail.
    """
    remaining = unit.end - unit.start if unit.end >= 0 else -1
    cur = _Cursor(sep, limit, json_field, b"", unit.start)
    total = 0
    while True:
        batch = RawBatch()
        want = _BLOCK if remaining < 0 else min(_BLOCK, remaining - total)
        chunk, error = read_block(stream, want) if want > 0 else (b"", None)
        total += len(chunk)
        eof = error is not None or not chunk or (remaining >= 0 and total >= remaining)
        if total == 0 and eof and error is None and unit.start == 0:
            batch.add_bad(0, None, "empty_file", "the file has no bytes", b"")
            yield batch
            return
        data, pos = cur.buf + chunk, 0
        if cur.big is not None:
            after = _skip_oversize(cur, cur.big, batch, data, eof)
            if after is None:  # the oversize record goes on past this block
                batch.next_line = cur.line
                yield batch
                continue
            pos = after
        pos = _split_records(cur, batch, data, pos, eof)
        rest = data[pos:]
        if eof:
            _end_unit(cur, batch, pos, rest, error)
            yield batch
            return
        _carry(cur, pos, rest)
        batch.next_line = cur.line
        yield batch


def _skip_oversize(
    cur: _Cursor, big: _Oversize, batch: RawBatch, data: bytes, eof: bool
) -> int | None:
    """Skip the oversize record `big` up to its end; record it once that end is in `data`.

    Returns the position in `data` after the record, or None when it continues past `data`
    (the cursor then keeps only the block's tail, where its separator may begin).
    """
    match = cur.sep.search(data) if cur.sep else None
    if match is None and not eof:
        keep = max(len(data) - 4096, 0)
        big.size += keep
        cur.line += data.count(b"\n", 0, keep)
        cur.base, cur.buf = cur.base + keep, data[keep:]
        return None
    stop, pos = (match.start(), match.end()) if match else (len(data), len(data))
    detail = f"record of {big.size + stop} bytes exceeds max_record_bytes={cur.limit}"
    batch.add_bad(big.offset, big.line, "record_too_large", detail, big.excerpt)
    cur.line += data.count(b"\n", 0, pos)
    cur.big = None
    return pos


def _split_records(cur: _Cursor, batch: RawBatch, data: bytes, pos: int, eof: bool) -> int:
    """Emit the records of `data` from `pos` that end at a separator; return where the rest is.

    Before the end of the unit, a separator at the very end of `data` may continue in the next
    block, so the record before it waits.
    """
    sep, base, line = cur.sep, cur.base, cur.line
    if sep is not None and sep.pattern == rb"\n":
        pos, line = _emit_lines(cur, batch, data, pos, eof)
    elif sep is not None:
        for match in sep.finditer(data, pos):
            if not eof and match.end() == len(data):
                break  # the separator may continue in the next block
            record = data[pos : match.start()]
            emit_bounded(batch, record, base + pos, line, cur.json_field, cur.limit)
            line += data.count(b"\n", pos, match.end())
            pos = match.end()
    cur.line = line
    return pos


def _end_unit(
    cur: _Cursor, batch: RawBatch, pos: int, rest: bytes, error: BaseException | None
) -> None:
    """Emit the unit's last record; after a read error, keep it and the break as bad records."""
    if error is None:
        emit_bounded(batch, rest, cur.base + pos, cur.line, cur.json_field, cur.limit)
    else:  # the partial record at the break, and the fact of the break, are kept
        reason = "truncated_compressed" if isinstance(error, EOFError) else "corrupt_compressed"
        batch.add_bad(cur.base + pos, cur.line, reason, f"{type(error).__name__}: {error}", rest)
    batch.next_line = cur.line


def _carry(cur: _Cursor, pos: int, rest: bytes) -> None:
    """Carry the unfinished record to the next block; skip one already over the limit."""
    if len(rest) > cur.limit:
        keep = len(rest) - 4096
        cur.big = _Oversize(cur.base + pos, cur.line, keep, rest[:EXCERPT])
        cur.line += rest.count(b"\n", 0, keep)
        cur.base, cur.buf = cur.base + pos + keep, rest[keep:]
    else:
        cur.base, cur.buf = cur.base + pos, rest
