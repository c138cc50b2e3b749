"""Document text clean-up (column-wise) and rule-based sentence splitting.

`clean_texts_reference` states the clean-up as pyarrow.compute (RE2) passes; `clean_texts`
runs the same steps as one compiled pass per document (`tasks/ingest/_textscan.c`) before and one
after Unicode normalisation, with byte-identical output (tests/tasks/ingest/test_textscan.py).
Pure functions only: no files, clock or globals beyond compiled patterns and word lists.
"""

from __future__ import annotations

import importlib
import re
import unicodedata
from collections.abc import Callable
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.ingest.sentences import split_column
from tasks.ingest.textscan import kernels

SentenceSplitter = Callable[[str], list[str]]


class CleanConfig(BaseModel):
    """How each document's text is normalised before filtering, hashing and splitting."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    normalization: Literal["NFC", "NFKC", "NFD", "NFKD", "none"] = Field(
        "NFC", description="Unicode normalisation form applied to every document."
    )
    strip_control: bool = Field(
        True, description="Remove C0/C1 control characters (keeping newline and tab) and BOMs."
    )
    collapse_whitespace: bool = Field(
        True,
        description="Collapse runs of spaces/tabs to one space, trim lines, squeeze blank lines.",
    )
    join_wrapped_lines: bool = Field(
        True,
        description="Join hard-wrapped lines (a single newline becomes a space); paragraph "
        "breaks (blank lines) become one newline.",
    )


class SentenceConfig(BaseModel):
    """Which sentence splitter runs on each document."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    splitter: str = Field(
        "rules",
        description="'rules' (built-in, abbreviation-aware), 'lines' (one sentence per line), "
        "'none' (the document is one sentence) or 'package.module:function' taking a str "
        "and returning a list of str.",
    )

    @field_validator("splitter")
    @classmethod
    def _known_or_importable(cls, value: str) -> str:
        if value in ("rules", "lines", "none") or re.fullmatch(r"[\w.]+:\w+", value):
            return value
        raise ValueError(
            f"{value!r} is not 'rules', 'lines', 'none' or a 'package.module:function' path"
        )


# Controls other than \t and \n, DEL, C1 controls and the BOM / zero-width no-break space.
_CONTROL_RE = r"[\x{0}-\x{8}\x{b}\x{c}\x{e}-\x{1f}\x{7f}-\x{9f}\x{feff}]"
_HSPACE_RE = r"[\t\v\f\p{Zs}]+"
# Placeholder for paragraph breaks while single newlines become spaces. With strip_control
# off, a \x01 already in the text becomes a newline too; the C path keeps that, byte for byte.
_PARAGRAPH_MARK = "\x01"


def clean_texts(texts: pa.Array, cfg: CleanConfig) -> pa.Array:
    """Normalise a string array column-wise; returns an array of the same length and type.

    The compiled form of `clean_texts_reference`, with the same output: its character steps
    run in C, and Unicode normalisation runs in between, as in the reference.
    """
    before = kernels.OP_NEWLINES | (kernels.OP_STRIP_CONTROL if cfg.strip_control else 0)
    after = kernels.OP_TRIM
    after |= kernels.OP_COLLAPSE if cfg.collapse_whitespace else 0
    after |= kernels.OP_JOIN if cfg.join_wrapped_lines else 0
    if cfg.normalization == "none":
        return _clean_utf8(texts, before | after)
    out = _normalize_non_ascii(_clean_utf8(texts, before), cfg.normalization)
    return _clean_utf8(out, after)


def _normalize_non_ascii(texts: pa.Array, form: str) -> pa.Array:
    """`normalize_unicode`, run on the non-ASCII texts only and spliced back in.

    An ASCII string is normalised in every form (UAX #15: ASCII characters have no
    decompositions and compose with nothing; CPython's `is_normalized` answers it without
    looking), so only the other texts need Python strings.
    """
    ascii_only = pc.fill_null(pc.string_is_ascii(texts), True)
    rows = np.flatnonzero(~ascii_only.to_numpy(zero_copy_only=False))
    if not len(rows):
        return texts
    values = texts.take(pa.array(rows)).to_pylist()
    changed = [
        (row, unicodedata.normalize(form, text))  # type: ignore[arg-type]
        for row, text in zip(rows, values, strict=True)
        if not unicodedata.is_normalized(form, text)  # type: ignore[arg-type]
    ]
    if not changed:
        return texts
    replacements = pa.array([text for _, text in changed], type=texts.type)
    picks = np.arange(len(texts))
    picks[[row for row, _ in changed]] = len(texts) + np.arange(len(changed))
    return pa.concat_arrays([texts, replacements]).take(pa.array(picks))


def _clean_utf8(texts: pa.Array, ops: int) -> pa.Array:
    """Run the `kernels.OP_*` steps in `ops` over every text; keeps nulls and the type."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    large = texts.cast(pa.large_string())
    _, offsets, data = large.buffers()
    window = offsets.slice(8 * large.offset, 8 * (len(large) + 1))  # n + 1 int64 offsets
    new_offsets, new_data = kernels.clean_utf8(window, b"" if data is None else data, ops)
    out = pa.LargeStringArray.from_buffers(
        len(large), pa.py_buffer(new_offsets), pa.py_buffer(new_data)
    )
    if large.null_count:
        out = pc.if_else(large.is_valid(), out, pa.scalar(None, pa.large_string()))
    return out if texts.type == pa.large_string() else out.cast(texts.type)


def clean_texts_reference(texts: pa.Array, cfg: CleanConfig) -> pa.Array:
    """Normalise a string array with pyarrow.compute passes: the specification of `clean_texts`.

    CRLF and lone CR become LF in every configuration, so that line-based rules see one newline.
    """
    out = pc.replace_substring_regex(texts, r"\r\n?", "\n")
    if cfg.strip_control:
        out = pc.replace_substring_regex(out, _CONTROL_RE, "")
    if cfg.normalization != "none":
        out = normalize_unicode(out, cfg.normalization)
    if cfg.collapse_whitespace:
        out = pc.replace_substring_regex(out, _HSPACE_RE, " ")
        out = pc.replace_substring_regex(out, r" ?\n ?", "\n")
        out = pc.replace_substring_regex(out, r"\n{3,}", "\n\n")
    if cfg.join_wrapped_lines:
        out = pc.replace_substring_regex(out, r"\n{2,}", _PARAGRAPH_MARK)
        out = pc.replace_substring(out, "\n", " ")
        out = pc.replace_substring(out, _PARAGRAPH_MARK, "\n")
        if cfg.collapse_whitespace:
            out = pc.replace_substring_regex(out, r" {2,}", " ")
    return pc.utf8_trim_whitespace(out)


def normalize_unicode(texts: pa.Array, form: str) -> pa.Array:
    """Apply a Unicode normalisation form with Python's `unicodedata`.

    pyarrow 25's `utf8_normalize` neither composes nor decomposes (NFC leaves 'e' + U+0301 as
    it is; tested in tests/tasks/ingest/test_text.py), so it cannot be used. `is_normalized` is a
    fast C check that skips the copy for the common, already-normalised document.
    """
    values = texts.to_pylist()
    out = [
        t if t is None or unicodedata.is_normalized(form, t) else unicodedata.normalize(form, t)  # type: ignore[arg-type]
        for t in values
    ]
    return pa.array(out, type=texts.type)


def split_sentences_rules(text: str) -> list[str]:
    """Split one document with the built-in rules (see `tasks.ingest.sentences`)."""
    return split_column(pa.array([text.strip()], pa.large_string())).to_pylist()[0]  # type: ignore[no-any-return]


def resolve_splitter(cfg: SentenceConfig) -> SentenceSplitter:
    """Return a per-document callable for `cfg.splitter`, importing a plug-in if needed.

    Raises:
        ValueError: the plug-in path cannot be imported or does not name a callable.
    """
    if cfg.splitter == "rules":
        return split_sentences_rules
    if cfg.splitter == "lines":
        return lambda text: [line.strip() for line in text.split("\n") if line.strip()]
    if cfg.splitter == "none":
        return lambda text: [text] if text else []
    module_name, _, attr = cfg.splitter.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"sentences.splitter {cfg.splitter!r} cannot be imported: {exc}") from exc
    if not callable(func):
        raise ValueError(f"sentences.splitter {cfg.splitter!r} is not callable")
    return func  # type: ignore[no-any-return]


def split_sentences(texts: pa.Array, cfg: SentenceConfig) -> pa.Array:
    """Split every (cleaned, trimmed) text into sentences; returns a `list<string>` array.

    The built-in splitters run vectorised over the whole column; a plug-in runs per document.
    """
    if cfg.splitter == "rules":
        return split_column(texts, "rules")
    if cfg.splitter == "lines":
        return split_column(texts, "lines")
    if cfg.splitter == "none":
        values = texts.cast(pa.string())
        offsets = pa.array(range(len(values) + 1), pa.int32())
        return pa.ListArray.from_arrays(offsets, values)
    splitter = resolve_splitter(cfg)
    return pa.array([splitter(t) for t in texts.to_pylist()], type=pa.list_(pa.string()))
