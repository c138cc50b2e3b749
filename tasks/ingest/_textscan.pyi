"""Stub of the compiled text kernels, `tasks/ingest/_textscan.c` (built by `pip install -e .`)."""

from typing_extensions import Buffer

OP_NEWLINES: int
OP_STRIP_CONTROL: int
OP_COLLAPSE: int
OP_JOIN: int
OP_TRIM: int
SOURCE_SHA256: str

class SentenceRules:
    """The `BOUNDARY` scan with these abbreviation forms (each `[A-Za-z0-9_.]`, 1-31 bytes)."""

    def __init__(self, abbreviations: list[bytes]) -> None: ...
    def gaps(self, blob: Buffer, /) -> bytes:
        """Return the `(start, end)` int64 pairs of every `BOUNDARY` gap in the UTF-8 `blob`."""

def line_gaps(blob: Buffer, /) -> bytes:
    """Return the `(start, end)` int64 pairs of every `LINE_BREAK` gap in `blob`."""

def clean_utf8(offsets: Buffer, data: Buffer, ops: int, /) -> tuple[bytes, bytes]:
    """Clean every text of a large_string array (n + 1 int64 offsets, UTF-8 data) with `ops`."""
