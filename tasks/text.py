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


# Words that end with a period but rarely end a sentence (lower-cased, without the period).
_ABBREVIATIONS = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "messrs",
        "mme",
        "mlle",
        "dr",
        "prof",
        "rev",
        "hon",
        "sr",
        "jr",
        "st",
        "mt",
        "ft",
        "capt",
        "col",
        "gen",
        "lt",
        "sgt",
        "cpl",
        "maj",
        "adm",
        "gov",
        "pres",
        "sen",
        "rep",
        "supt",
        "insp",
        "esq",
        "vs",
        "cf",
        "viz",
        "al",
        "approx",
        "dept",
        "est",
        "fig",
        "figs",
        "eq",
        "eqs",
        "no",
        "nos",
        "vol",
        "vols",
        "pp",
        "ch",
        "sec",
        "art",
        "ed",
        "eds",
        "op",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "inc",
        "ltd",
        "co",
        "corp",
        "bros",
        "ave",
        "blvd",
        "rd",
        "e.g",
        "i.e",
        "a.k.a",
    ]
)

# A candidate boundary: terminal punctuation, optional closing quotes/brackets, whitespace, and a
# next sentence that starts with an upper-case letter or digit (after optional opening quotes).
_BOUNDARY = re.compile(
    r"""(?P<term>[.!?\u2026]+)(?P<close>['"\u201d\u2019\u00bb)\]]*)\s+"""
    r"""(?=['"\u201c\u2018\u00ab(\[]*[0-9A-Z\u00c0-\u00d6\u00d8-\u00de\u0391-\u03a9\u0400-\u042f])"""
)
# Full stops of scripts that do not put a space after them (CJK).
_CJK_BOUNDARY = re.compile(r"[\u3002\uff01\uff1f]+[\u300d\u300f\uff09]*")
_WORD_BEFORE = re.compile(r"(\S+)$")
_UPPER_ACRONYM = re.compile(r"(?:[A-Z]\.){2,}$")
_INITIAL = re.compile(r"(?:^|[\s(\"'])[A-Z]$")
_ENUMERATOR = re.compile(r"^\d{1,3}$")


def _is_false_boundary(line: str, match: re.Match[str]) -> bool:
    """Decide whether a '.'-terminated candidate is an abbreviation, initial or enumerator."""
    if match.group("term") != ".":
        return False
    # A bounded window: scanning the whole line prefix would make long paragraphs quadratic.
    start = max(match.start() - 64, 0)
    head = line[start : match.start()]
    word = _WORD_BEFORE.search(head)
    if word is None:
        return False
    token = word.group(1).lstrip("\"'([\u201c\u2018")
    if token.lower().rstrip(".") in _ABBREVIATIONS:
        return True
    if _UPPER_ACRONYM.search(token + "."):  # U.S. Army, Ph.D.: not split
        return True
    if _INITIAL.search(head):  # J. R. R. Tolkien
        return True
    # "1. First item" at the start of a line is a list enumerator, not a sentence.
    return bool(_ENUMERATOR.match(token)) and start == 0 and word.start() == 0


def split_sentences_rules(text: str) -> list[str]:
    """Split a document into sentences with abbreviation-, initial- and quote-aware rules.

    Every line break is a boundary; within a line a boundary is terminal punctuation (plus any
    closing quotes) followed by whitespace and an upper-case letter or digit, unless the word
    before it is a known abbreviation, an initial or a leading enumerator. Decimals never split
    (no whitespace follows their point). Sentences are stripped, non-empty slices of `text`.
    """
    sentences: list[str] = []
    for line in text.split("\n"):
        start = 0
        for match in _BOUNDARY.finditer(line):
            if _is_false_boundary(line, match):
                continue
            end = match.end("close")
            _append_cjk_split(sentences, line[start:end])
            start = match.end()
        _append_cjk_split(sentences, line[start:])
    return sentences


def _append_cjk_split(sentences: list[str], piece: str) -> None:
    start = 0
    for match in _CJK_BOUNDARY.finditer(piece):
        part = piece[start : match.end()].strip()
        if part:
            sentences.append(part)
        start = match.end()
    tail = piece[start:].strip()
    if tail:
        sentences.append(tail)


def _split_lines(text: str) -> list[str]:
    return [line.strip() for line in text.split("\n") if line.strip()]


def _split_none(text: str) -> list[str]:
    return [text] if text else []


def resolve_splitter(cfg: SentenceConfig) -> SentenceSplitter:
    """Return the splitter callable `cfg.splitter` names, importing a plug-in if needed.

    Raises:
        ValueError: the plug-in path cannot be imported or does not name a callable.
    """
    builtin: dict[str, SentenceSplitter] = {
        "rules": split_sentences_rules,
        "lines": _split_lines,
        "none": _split_none,
    }
    if cfg.splitter in builtin:
        return builtin[cfg.splitter]
    module_name, _, attr = cfg.splitter.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"sentences.splitter {cfg.splitter!r} cannot be imported: {exc}") from exc
    if not callable(func):
        raise ValueError(f"sentences.splitter {cfg.splitter!r} is not callable")
    return func  # type: ignore[no-any-return]


def split_sentences(texts: pa.Array, splitter: SentenceSplitter) -> pa.Array:
    """Apply `splitter` to every string of `texts`; returns a `list<string>` array."""
    return pa.array([splitter(text) for text in texts.to_pylist()], type=pa.list_(pa.string()))
