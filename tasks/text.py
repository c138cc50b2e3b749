"""Document text clean-up (column-wise, pyarrow.compute) and rule-based sentence splitting.

Pure functions only: no files, clock or globals beyond compiled patterns and word lists.
"""

from __future__ import annotations

import importlib
import re
import unicodedata
from collections.abc import Callable
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.sentences import BOUNDARY, LINE_BREAK, split_column

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
_PARAGRAPH_MARK = "\x01"  # safe as a placeholder: control characters were removed before


def clean_texts(texts: pa.Array, cfg: CleanConfig) -> pa.Array:
    """Normalise a string array column-wise; returns an array of the same length.

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
    it is; tested in tests/tasks/test_text.py), so it cannot be used. `is_normalized` is a fast
    C check that skips the copy for the common, already-normalised document.
    """
    values = texts.to_pylist()
    out = [
        t if t is None or unicodedata.is_normalized(form, t) else unicodedata.normalize(form, t)  # type: ignore[arg-type]
        for t in values
    ]
    return pa.array(out, type=texts.type)


def split_sentences_rules(text: str) -> list[str]:
    """Split one document with the built-in rules (see `tasks.sentences`)."""
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
        return split_column(texts, BOUNDARY)
    if cfg.splitter == "lines":
        return split_column(texts, LINE_BREAK)
    if cfg.splitter == "none":
        values = texts.cast(pa.string())
        offsets = pa.array(range(len(values) + 1), pa.int32())
        return pa.ListArray.from_arrays(offsets, values)
    splitter = resolve_splitter(cfg)
    return pa.array([splitter(t) for t in texts.to_pylist()], type=pa.list_(pa.string()))
