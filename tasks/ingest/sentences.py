"""The built-in rule-based sentence splitter, vectorised over a whole column.

The rules are one bytes regex, `BOUNDARY` (`LINE_BREAK` for the 'lines' splitter), matched over
the UTF-8 text of a whole batch; the exception rules (abbreviations, initials, dotted acronyms,
leading enumerators) are fixed-width negative lookbehinds inside it. The regex is the
specification: `split_column_reference` runs it with Python `re`, and `split_column` runs the
compiled scan of `tasks/ingest/_textscan.c`, which finds the same gaps
(tests/tasks/ingest/test_textscan.py) in a small fraction of the time (docs/benchmarks.md). Sentence
slices are then cut with NumPy and assembled into an Arrow `list<string>` without creating a Python
string per sentence.
"""

from __future__ import annotations

import re
from itertools import groupby
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from tasks.ingest.textscan import kernels

# Words that end with a period but rarely end a sentence (lower-cased, without the period).
ABBREVIATIONS = frozenset(
    """
    mr mrs ms messrs mme mlle dr prof rev hon sr jr st mt ft capt col gen lt sgt cpl maj adm
    gov pres sen rep supt insp esq vs cf viz al approx dept est fig figs eq eqs no nos vol
    vols pp ch sec art ed eds op jan feb mar apr jun jul aug sep sept oct nov dec inc ltd co
    corp bros ave blvd rd e.g i.e a.k.a
    """.split()  # noqa: SIM905 - a word list reads best as text
)


def abbreviation_forms() -> list[bytes]:
    """Every abbreviation in its three casings (mr, Mr, MR) as UTF-8, shortest first."""
    forms = {f for w in ABBREVIATIONS for f in (w, w.capitalize(), w.upper())}
    return sorted((f.encode() for f in forms), key=lambda f: (len(f), f))


def _abbreviation_guards() -> bytes:
    """One lookbehind per word length (Python's `re` needs fixed width) over all casings.

    Evaluated just after a period: it is no boundary when the word before it is an
    abbreviation standing alone (after a non-word character or at the start of a line).
    """
    guards = []
    for _, group in groupby(abbreviation_forms(), key=len):
        words = b"|".join(re.escape(w) for w in group)
        guards.append(rb"(?<![^\w.](?:" + words + rb")\.)")
        guards.append(rb"(?<!^(?:" + words + rb")\.)")
    return b"".join(guards)


_CAPITAL = rb"(?:[A-Z0-9]|\xc3[\x80-\x96\x98-\x9e]|\xce[\x91-\xa9]|\xd0[\x90-\xaf])"
_OPEN = rb"""(?:['"(\[]|\xe2\x80\x9c|\xe2\x80\x98|\xc2\xab)"""
_CLOSE = rb"""(?:['")\]]|\xe2\x80\x9d|\xe2\x80\x99|\xc2\xbb)"""
# The period comes first so that the guards after it run only where there is a period.
_PERIOD = (
    rb"\.(?<!\.\.)(?!\.)"
    + _abbreviation_guards()
    + rb"(?<![\s(\"'][A-Z]\.)(?<!^[A-Z]\.)"  # an initial: J. R. R. Tolkien
    + rb"(?<!\.[A-Z]\.)"  # a dotted upper-case acronym: U.S., Ph.D.
    + rb"(?<!^\d\.)(?<!^\d\d\.)(?<!^\d\d\d\.)"  # a leading enumerator: "1. Buy milk."
)
_TERMINAL = rb"(?:" + _PERIOD + rb"|\.\.+|\xe2\x80\xa6|[!?][.!?]*)"
_CJK = (
    rb"[\xe3\xef](?:(?<=\xe3)\x80\x82|(?<=\xef)\xbc[\x81\x9f])(?:\xe3\x80[\x8d\x8f]|\xef\xbc\x89)*"
)
#: Boundaries: terminal punctuation (+ closing quotes) before whitespace and a capital or digit;
#: any line break; CJK full stops. Exactly one `gap` group (what lies between two sentences)
#: takes part in each match.
BOUNDARY = re.compile(
    rb"(?:" + _TERMINAL + _CLOSE + rb"*(\s+)(?=" + _OPEN + rb"*" + _CAPITAL + rb")"
    rb"|" + _CJK + rb"(\s*)"
    rb"|([ \t]*\n\s*))",
    re.MULTILINE,
)
LINE_BREAK = re.compile(rb"([ \t]*\n\s*)")


#: The compiled BOUNDARY scan, given the same abbreviation forms as the regex.
_RULES = kernels.SentenceRules(abbreviation_forms())
Splitter = Literal["rules", "lines"]
Gaps = npt.NDArray[np.int64]


def boundary_gaps(blob: Any, splitter: Splitter = "rules") -> Gaps:
    """Return the `(start, end)` gap of every boundary in `blob` (UTF-8), as an (n, 2) array.

    The compiled scan: the same gaps as `boundary_gaps_reference` with `BOUNDARY` ('rules') or
    `LINE_BREAK` ('lines'). `blob` is any buffer (bytes, `pa.Buffer`); it is not copied.
    """
    raw = _RULES.gaps(blob) if splitter == "rules" else kernels.line_gaps(blob)
    return np.frombuffer(raw, dtype=np.int64).reshape(-1, 2)


def boundary_gaps_reference(blob: bytes, pattern: re.Pattern[bytes] = BOUNDARY) -> Gaps:
    """Return the gap of every `pattern` match (its one participating group), with Python `re`."""
    spans = [m.span(m.lastindex) for m in pattern.finditer(blob)]  # type: ignore[arg-type]
    return np.array(spans, dtype=np.int64).reshape(-1, 2)


def split_column(texts: pa.Array, splitter: Splitter = "rules") -> pa.Array:
    """Split every (trimmed) text of a string column at its boundaries; returns list<string>.

    The UTF-8 bytes of the whole column are scanned once; sentences are the slices between
    boundaries with each boundary's gap dropped, so they never cross a document and are never
    empty. Gaps are ASCII whitespace, so every cut falls on a character boundary.
    """
    texts = texts.cast(pa.large_string())
    n = len(texts)
    # Join with "\n" in C++: a line break is a boundary, and `^` then marks every document start.
    listed = pa.LargeListArray.from_arrays(pa.array([0, n], pa.int64()), texts)
    joined = pc.binary_join(listed, pa.scalar("\n", pa.large_string()))
    blob = joined[0].as_buffer() if n else pa.py_buffer(b"")
    gaps = boundary_gaps(blob, splitter)
    starts = np.concatenate([[0], gaps[:, 1]])
    ends = np.concatenate([gaps[:, 0], [blob.size]])
    # Alternate sentence and gap pieces over the blob, then keep the non-empty sentences:
    # Arrow's take copies just their bytes, in C++.
    pieces = np.empty(2 * len(starts), dtype=np.int64)
    pieces[0::2], pieces[1::2] = starts, ends
    every = pa.LargeStringArray.from_buffers(len(pieces) - 1, pa.py_buffer(pieces), blob)
    nonempty = np.flatnonzero(ends > starts)
    sentences = every.take(pa.array(2 * nonempty)).cast(pa.string())
    # A document's sentences are those starting between its first byte and the next document's.
    lengths = pc.binary_length(texts).to_numpy(zero_copy_only=False).astype(np.int64)
    doc_starts = np.cumsum(lengths + 1) - (lengths + 1)
    first = np.searchsorted(starts[nonempty], doc_starts, side="left")
    list_offsets = np.append(first, len(nonempty)).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(list_offsets, pa.int32()), sentences)


def split_column_reference(texts: pa.Array, pattern: re.Pattern[bytes] = BOUNDARY) -> pa.Array:
    """`split_column` with Python `re` finding `pattern`: the specification (slow, kept as is).

    The UTF-8 bytes of the whole column are matched once; sentences are the slices between
    boundaries with each boundary's `gap` dropped, so they never cross a document and are
    never empty. Gaps are ASCII whitespace, so every cut falls on a character boundary.
    """
    texts = texts.cast(pa.large_string())
    n = len(texts)
    # Join with "\n" in C++: a line break is a boundary, and `^` then marks every document start.
    listed = pa.LargeListArray.from_arrays(pa.array([0, n], pa.int64()), texts)
    joined = pc.binary_join(listed, pa.scalar("\n", pa.large_string()))
    blob = joined[0].as_buffer().to_pybytes() if n else b""
    lengths = pc.binary_length(texts).to_numpy(zero_copy_only=False).astype(np.int64)
    doc_starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]]).astype(np.int64)
    gaps = boundary_gaps_reference(blob, pattern)
    starts = np.concatenate([[0], gaps[:, 1]])
    ends = np.concatenate([gaps[:, 0], [len(blob)]])
    # Alternate sentence and gap pieces over the blob, then keep the non-empty sentences:
    # Arrow's take copies just their bytes, in C++.
    pieces = np.empty(2 * len(starts), dtype=np.int64)
    pieces[0::2], pieces[1::2] = starts, ends
    every = pa.LargeStringArray.from_buffers(
        len(pieces) - 1, pa.py_buffer(pieces.tobytes()), pa.py_buffer(blob)
    )
    nonempty = np.flatnonzero(ends > starts)
    sentences = every.take(pa.array(2 * nonempty)).cast(pa.string())
    starts = starts[nonempty]
    owner = np.searchsorted(doc_starts, starts, side="right") - 1
    counts = np.bincount(owner, minlength=n)
    list_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(list_offsets, pa.int32()), sentences)
