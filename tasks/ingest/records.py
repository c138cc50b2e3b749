"""What readers produce: column batches of raw records, and the per-record checks.

A record's bytes become text here, or a quarantine entry with its reason: NUL bytes, invalid
UTF-8, malformed or mistyped JSON, or a record over the size limit.
"""

from __future__ import annotations

import codecs
import zlib
from dataclasses import dataclass, field
from typing import IO, Any

import orjson
import zstandard

from tasks.ingest.sources import RawRecord

EXCERPT = 256  # bytes of a bad record kept in the quarantine
DECOMPRESS_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError, ValueError)


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
        self.bad.append(RawRecord(offset, line, None, reason, detail, raw[:EXCERPT]))


def read_block(stream: IO[bytes], want: int) -> tuple[bytes, BaseException | None]:
    """Read up to `want` bytes in 1 MiB pieces; on a decompression error return what was read.

    Reading in pieces matters for compressed input: an error inside one large `read()` would
    lose everything that call had decompressed.
    """
    parts: list[bytes] = []
    got = 0
    while got < want:
        try:
            piece = stream.read(min(1 << 20, want - got))
        except DECOMPRESS_ERRORS as exc:
            return b"".join(parts), exc
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    return b"".join(parts), None


def emit_bounded(
    batch: RawBatch, raw: bytes, offset: int, line: int, json_field: str | None, limit: int
) -> None:
    """Quarantine `raw` as `record_too_large` if over `limit`, else `emit` it."""
    if len(raw) > limit:
        detail = f"record of {len(raw)} bytes exceeds max_record_bytes={limit}"
        batch.add_bad(offset, line, "record_too_large", detail, raw)
    else:
        emit(batch, raw, offset, line, json_field)


def emit(
    batch: RawBatch,
    raw: bytes,
    offset: int,
    line: int | None,
    json_field: str | None,
    *,
    blank_is_record: bool = False,
) -> None:
    """Decode one raw record into `batch` (as text, or a JSON field) or quarantine it."""
    if offset == 0 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[3:]  # before the blank check: a line holding only a BOM is blank
    if not blank_is_record and not raw.strip():
        return  # blank lines separate records in text files; they are not records
    if b"\x00" in raw:
        batch.add_bad(offset, line, "nul_byte", f"NUL byte at +{raw.index(0)}", raw)
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        batch.add_bad(offset, line, "invalid_utf8", f"invalid UTF-8 at +{exc.start}", raw)
        return
    if json_field is not None:
        emit_json(batch, text, raw, offset, line, json_field)
        return
    batch.offsets.append(offset)
    batch.lines.append(line)
    batch.texts.append(text)


def emit_json(
    batch: RawBatch, text: str, raw: bytes, offset: int, line: int | None, key: str
) -> None:
    """Parse one JSON Lines record and emit its `key` field."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        batch.add_bad(offset, line, "malformed_json", str(exc), raw)
        return
    emit_value(batch, obj, raw, offset, line, key)


def emit_value(
    batch: RawBatch,
    obj: Any,
    raw: bytes,
    offset: int,
    line: int | None,
    key: str,
    *,
    check_surrogates: bool = False,
) -> None:
    r"""Emit `obj[key]` if `obj` is an object holding a string there, else quarantine it.

    `check_surrogates`: `obj` came from Python's `json`, which (unlike orjson) decodes a lone
    `\ud800`-style escape into a string that is not valid Unicode: quarantine it as
    `invalid_utf8` instead of failing when the shard is written.
    """
    if not isinstance(obj, dict) or key not in obj or obj[key] is None:
        what = "not a JSON object" if not isinstance(obj, dict) else f"no field {key!r}"
        batch.add_bad(offset, line, "missing_field", what, raw)
    elif not isinstance(obj[key], str):
        kind = type(obj[key]).__name__
        batch.add_bad(offset, line, "wrong_type", f"field {key!r} is {kind}, not str", raw)
    else:
        if check_surrogates:
            try:
                obj[key].encode("utf-8")
            except UnicodeEncodeError as exc:
                detail = f"field {key!r} holds a lone surrogate at +{exc.start}"
                batch.add_bad(offset, line, "invalid_utf8", detail, raw)
                return
        batch.offsets.append(offset)
        batch.lines.append(line)
        batch.texts.append(obj[key])
