# ruff: noqa: RUF001 - the inputs are confusable characters (fullwidth, curly quotes) on purpose
"""The compiled kernels (tasks/ingest/_textscan.c) give byte-identical output to the Python
references.

References: `split_column_reference` / `boundary_gaps_reference` (Python `re` with `BOUNDARY`
and `LINE_BREAK`) and `clean_texts_reference` (pyarrow.compute RE2 passes). Inputs: generated
edge-case texts, every code point, and every file of the real corpora in ../shared/data.
"""

import importlib
import itertools
import random
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import tasks
import tasks.ingest.textscan
from tasks.ingest.sentences import (
    ABBREVIATIONS,
    BOUNDARY,
    LINE_BREAK,
    boundary_gaps,
    boundary_gaps_reference,
    split_column,
    split_column_reference,
)
from tasks.ingest.text import CleanConfig, clean_texts, clean_texts_reference

PATTERNS = {"rules": BOUNDARY, "lines": LINE_BREAK}
ALL_CLEAN_CONFIGS = [
    CleanConfig(normalization=n, strip_control=s, collapse_whitespace=c, join_wrapped_lines=j)
    for n, s, c, j in itertools.product(
        ["NFC", "NFKC", "NFD", "NFKD", "none"], [True, False], [True, False], [True, False]
    )
]
# For the big inputs: each step's character class seen with and without the steps before it.
FLAG_CONFIGS = [
    CleanConfig(normalization="none"),
    CleanConfig(normalization="none", strip_control=False),
    CleanConfig(normalization="none", strip_control=False, collapse_whitespace=False),
    CleanConfig(
        normalization="none",
        strip_control=False,
        collapse_whitespace=False,
        join_wrapped_lines=False,
    ),
]
CODE_POINTS = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]


def assert_same_clean(texts: pa.Array, cfg: CleanConfig) -> None:
    got, want = clean_texts(texts, cfg), clean_texts_reference(texts, cfg)
    assert got.type == want.type
    if not got.equals(want):
        rows = zip(texts.to_pylist(), got.to_pylist(), want.to_pylist(), strict=True)
        raw, g, w = next((r, g, w) for r, g, w in rows if g != w)
        pytest.fail(f"{cfg}: {raw!r} -> compiled {g!r}, reference {w!r}")


def assert_same_split(texts: pa.Array) -> None:
    for splitter, pattern in PATTERNS.items():
        got, want = split_column(texts, splitter), split_column_reference(texts, pattern)
        if not got.equals(want):
            rows = zip(texts.to_pylist(), got.to_pylist(), want.to_pylist(), strict=True)
            raw, g, w = next((r, g, w) for r, g, w in rows if g != w)
            pytest.fail(f"{splitter}: {raw!r} -> compiled {g!r}, reference {w!r}")


def assert_same_gaps(blob: bytes) -> None:
    for splitter, pattern in PATTERNS.items():
        got, want = boundary_gaps(blob, splitter), boundary_gaps_reference(blob, pattern)
        assert got.dtype == np.int64
        assert got.tolist() == want.tolist(), (splitter, blob[:200])


# ----------------------------------------------------------------------------------------------
# Generated texts: abbreviations in every casing, initials, acronyms, enumerators, ellipses,
# quotes and brackets, CJK, CRLF, controls, tabs, NBSP and other spaces, combining marks.

PIECES = [
    *["word", "Word", "WORD", "x", "A", "Z", "é", "É", "Ö", "×", "Ø", "ß", "Ω", "ά", "Я", "я"],
    *["1", "12", "123", "1234", "3.14", "$4.50", "p.m.", "U.S.", "Ph.D.", "e.g.", "E.G."],
    *["i.e.", "a.k.a.", "A.K.A.", ".", "..", "...", "....", "…", "!", "?", "?!", "!.", ".?"],
    *["'", '"', "“", "”", "‘", "’", "«", "»", "(", ")", "[", "]", "。", "！", "？", "」", "』"],
    *["）", "第一句", "Ａ", "ﬁ", " ", " ", "  ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r"],
    *["\v", "\f", "\u00a0", "\u2000", "\u2009", "\u200a", "\u200b", "\u202f", "\u205f"],
    *["\u3000", "\u1680", "\u180e", "\u2028", "\u2029", "\u0085", "\x00", "\x01", "\x07"],
    *["\x1c", "\x1f", "\x7f", "\x80", "\x9f", "\ufeff", "\u00ad", "e\u0301", "A\u030a"],
    *["\u1100\u1161", "😀", "한국"],
]
STARTS = ["A", "Z", "0", "9", "É", "Ö", "×", "Ø", "Ω", "ά", "Я", "Ж", "я", "a", "ß", "ǅ", "「"]
OPENS = ["", "", "", "'", '"', "“", "‘", "«", "(", "[", "((", "\"'"]
CLOSES = ["", "", "", "'", '"', "”", "’", "»", ")", "]", "')", "」", "』", "）"]
TERMINALS = [".", ".", ".", "!", "?", "...", "..", "…", "?!", "!.", "。", "！", "？", ";", ""]
SPACES = [" ", " ", " ", "  ", "\t", "\n", " \n ", "\n\n", "\u00a0", "\u3000", "", "\r\n", "\v"]
WORDS = ["word", "it", "Mr", "dr", "U.S", "J", "J. R. R", "1", "12", "1234", "e.g", "Ph.D", "no"]


def random_abbreviation(rng: random.Random) -> str:
    word = rng.choice(sorted(ABBREVIATIONS))
    word = rng.choice([word, word.capitalize(), word.upper(), word.swapcase(), word.title()])
    return word + rng.choice([".", ".", "", ". ", ".."])


def random_token(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.25:
        return random_abbreviation(rng)
    if roll < 0.35:  # an initial or an enumerator
        return rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcxyz0123456789") + "."
    return rng.choice(PIECES)


def random_soup(rng: random.Random) -> str:
    """Tokens glued with little or no space: every rule next to every other."""
    tokens = (random_token(rng) + rng.choice(["", " ", " ", "\n", "  "]) for _ in range(40))
    return "".join(itertools.islice(tokens, rng.randint(0, 40)))


def random_prose(rng: random.Random) -> str:
    """Sentence-shaped text: opener, capital, words, terminal, closer, whitespace."""
    sentences = []
    for _ in range(rng.randint(0, 12)):
        words = [random_token(rng) if rng.random() < 0.3 else rng.choice(WORDS) for _ in range(5)]
        sentences.append(
            rng.choice(OPENS)
            + rng.choice(STARTS)
            + rng.choice(["", " "])
            + " ".join(words[: rng.randint(1, 5)])
            + rng.choice(TERMINALS)
            + rng.choice(CLOSES)
            + rng.choice(SPACES)
        )
    return "".join(sentences)


def generated_texts(seed: int, count: int = 400) -> pa.Array:
    rng = random.Random(seed)
    make = [random_soup, random_prose]
    return pa.array([rng.choice(make)(rng) for _ in range(count)], pa.large_string())


@pytest.mark.parametrize("seed", range(8))
def test_compiled_split_matches_regex_on_generated_texts(seed: int) -> None:
    texts = generated_texts(seed)
    assert_same_split(texts)
    for text in texts.to_pylist()[:100]:
        assert_same_gaps(text.encode())


@pytest.mark.parametrize("seed", range(4))
def test_compiled_clean_matches_pyarrow_on_generated_texts_in_every_config(seed: int) -> None:
    texts = generated_texts(100 + seed, count=200)
    for cfg in ALL_CLEAN_CONFIGS:
        assert_same_clean(texts, cfg)
        cleaned = clean_texts(texts, cfg)
        assert_same_split(cleaned)


def test_compiled_split_matches_regex_on_every_abbreviation_in_every_context() -> None:
    words = sorted(ABBREVIATIONS)
    casings = {f(w) for w in words for f in (str, str.capitalize, str.upper, str.swapcase)}
    befores = ["", "\n", " ", "(", '"', ".", "x", "_", "1", "é", "x."]
    afters = [". A", ". a", ".. A", ". (A", '." A', ".\nA", "."]
    texts = [b + w + a for w in sorted(casings) for b in befores for a in afters]
    assert_same_split(pa.array(texts))
    assert_same_gaps("\n".join(texts).encode())


def test_compiled_split_matches_regex_on_initials_enumerators_and_acronyms() -> None:
    heads = ["", "\n", " ", "(", "'", '"', ".", "x", "é", "1", "12", "123", "\n1", " 12"]
    cores = ["A.", "Z.", "a.", "1.", "12.", "123.", "1234.", "U.S.", "Ph.D.", "A.B.C.", "J. R."]
    tails = [" A", " a", "  B", "\tC", "\n", " “D", " «É", " 7", "", ")) X", "’ Я"]
    texts = [h + c + t for h in heads for c in cores for t in tails]
    assert_same_split(pa.array(texts))
    assert_same_gaps("\n".join(texts).encode())


def test_compiled_split_matches_regex_on_edge_shapes() -> None:
    texts = ["", " ", "\n", ".", "A.", ". A", "!!!!!! A", "." * 50 + " A", " \t \n \t x", "。"]
    texts += ["!?.!?. A", "x.\u3002 A", "」。」 A", "x. \n b", "x\t\t\t", "x" + " " * 1000 + "\nY"]
    assert_same_split(pa.array(texts))
    assert_same_split(pa.array([], pa.string()))
    for text in texts:
        assert_same_gaps(text.encode())


@pytest.mark.slow
def test_compiled_split_matches_regex_after_a_terminal_for_every_code_point() -> None:
    # Each code point as opener/capital after a boundary, as closer before one, and as gap.
    texts = [f"Ab. {c}x. {c}A x.{c} B x{c}. C. x!{c}D" for c in CODE_POINTS]
    assert_same_split(pa.array(texts))


@pytest.mark.slow
def test_compiled_clean_matches_pyarrow_for_every_code_point() -> None:
    # Each code point leading, trailing, doubled, and next to newlines, spaces and CRs.
    texts = pa.array([f"{c}a{c}{c} \n{c}\r\n b{c}\n\n{c}" for c in CODE_POINTS])
    for cfg in FLAG_CONFIGS:
        assert_same_clean(texts, cfg)


def test_compiled_clean_keeps_nulls_slices_and_the_string_type() -> None:
    values = [" a\r\nb ", None, "\x07c\u00a0 d", "", None, "e\u0301"]
    for array in (pa.array(values), pa.array(values, pa.large_string())):
        for cfg in (CleanConfig(), CleanConfig(normalization="none")):
            assert_same_clean(array, cfg)
            assert_same_clean(array.slice(1, 4), cfg)
            assert clean_texts(array, cfg).type == array.type
    chunked = pa.chunked_array([["a  b"], [" c\r\n"]])
    assert clean_texts(chunked, CleanConfig()).to_pylist() == ["a b", "c"]


def test_ascii_text_is_normalised_in_every_form_by_the_unicode_data() -> None:
    # Why clean_texts may skip ASCII texts: no ASCII character decomposes or reorders, and no
    # canonical decomposition ends in an ASCII character, so nothing composes onto one.
    for c in map(chr, range(128)):
        assert unicodedata.decomposition(c) == ""
        assert unicodedata.combining(c) == 0
    for c in CODE_POINTS:
        parts = unicodedata.decomposition(c).split()
        if len(parts) == 2 and not parts[0].startswith("<"):
            assert int(parts[1], 16) >= 0x80, (hex(ord(c)), parts)


# ----------------------------------------------------------------------------------------------
# Real corpora: every file, as a whole, by lines (CRLF kept) and by paragraphs.


def corpus_texts(path: Path) -> pa.Array:
    raw = path.read_bytes().decode("utf-8", errors="replace")
    docs = [raw, *raw.splitlines(keepends=True), *raw.split("\n\n")]
    return pa.array(docs, pa.large_string())


def shared_files(shared_data: Path) -> list[Path]:
    files = sorted(p for p in shared_data.rglob("*") if p.is_file())
    assert len(files) >= 40, files
    return files


@pytest.mark.slow
def test_compiled_clean_matches_pyarrow_on_every_real_corpus(shared_data: Path) -> None:
    for path in shared_files(shared_data):
        texts = corpus_texts(path)
        for cfg in FLAG_CONFIGS:
            assert_same_clean(texts, cfg)
        for form in ("NFC", "NFKC"):
            assert_same_clean(texts, CleanConfig(normalization=form))


@pytest.mark.slow
def test_compiled_split_matches_regex_on_every_real_corpus(shared_data: Path) -> None:
    for path in shared_files(shared_data):
        texts = corpus_texts(path)
        assert_same_split(texts)
        assert_same_split(clean_texts(texts, CleanConfig()))
        assert_same_gaps(path.read_bytes())


# ----------------------------------------------------------------------------------------------
# Loud failure: a missing or stale build is an ImportError that says how to build.


@pytest.fixture
def reload_textscan(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    yield monkeypatch
    monkeypatch.undo()
    importlib.reload(tasks.ingest.textscan)


def test_textscan_refuses_a_missing_build(reload_textscan: pytest.MonkeyPatch) -> None:
    reload_textscan.setitem(sys.modules, "tasks.ingest._textscan", None)
    reload_textscan.delattr(tasks.ingest, "_textscan")
    with pytest.raises(ImportError, match=r"not built .*pip install -e \."):
        importlib.reload(tasks.ingest.textscan)


def test_textscan_refuses_a_stale_build(reload_textscan: pytest.MonkeyPatch) -> None:
    reload_textscan.setattr(tasks.ingest.textscan.kernels, "SOURCE_SHA256", "0" * 64)
    with pytest.raises(ImportError, match=r"another version .*pip install -e \."):
        importlib.reload(tasks.ingest.textscan)


def test_sentence_rules_refuse_bad_abbreviations() -> None:
    kernels = tasks.ingest.textscan.kernels
    with pytest.raises(TypeError, match="bytes"):
        kernels.SentenceRules(["mr"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="1 to 31 bytes"):
        kernels.SentenceRules([b""])
    with pytest.raises(ValueError, match="ASCII letters"):
        kernels.SentenceRules([b"m r"])
    assert kernels.SentenceRules([]).gaps(b"Mr. Smith") == np.array([3, 4], np.int64).tobytes()
