r"""An exact, faster encoder for byte-level BPE tokenizers (GPT-2 and RoBERTa style).

`tokenizers` spends most of a byte-level BPE encode in its pre-tokenizer: the GPT-2 split
pattern, run by Oniguruma, takes longer than the BPE merges and everything else together (on the
benchmark corpus 5.2 s of pre-tokenization for 10 MiB, against 1.0 s for the same pattern in
Python's `re`). `SegmentEncoder` keeps `tokenizers` for everything it is fast at and replaces
only that split, for the text where the replacement is provably the same:

- Only ASCII segments take the fast path. On ASCII text the GPT-2 pattern's Unicode classes are
  plain sets (`\p{L}` = `[A-Za-z]`, `\p{N}` = `[0-9]`, `\s` = `[\t\n\v\f\r ]`), so
  `ASCII_SPLIT` spells them out and no Unicode-table version can make the two engines differ.
- A segment holding an added token's text (`<|endoftext|>`, `<mask>`, in any case) or a NUL (the
  separator below) goes through `tokenizers`, as does every non-ASCII segment.
- Each distinct word is mapped to byte-level characters with the tokenizer's own byte table and
  encoded once by the tokenizer's own BPE model; a per-worker cache keeps the ids of words seen.
- Only tokenizers of the shape lmpipe trains or imports for this family qualify: a BPE model
  without dropout, a `ByteLevel` pre-tokenizer with its regex and no prefix space, no normalizer
  or a `Lowercase` one, no truncation or padding. Anything else uses `tokenizers` throughout.

The ids equal `Tokenizer.encode_batch_fast(segments, add_special_tokens=False)`; tests check it
on real corpora, the GPT-2 reference vocabulary and random ASCII strings of every character.
"""

from __future__ import annotations

import json
import re
from itertools import chain
from typing import Any

import numpy as np
from tokenizers import Tokenizer

# GPT-2's pattern restricted to ASCII, plus NUL as a segment separator that matches alone: the
# lookahead treats NUL as the end of a segment, so whitespace before it splits as at the end.
_WS = r"\t\n\v\f\r "
ASCII_SPLIT = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+"
    rf"| ?[^{_WS}A-Za-z0-9\x00]+|[{_WS}]+(?![^{_WS}\x00])|[{_WS}]+|\x00"
)
_SEPARATOR = "\x00"
_SEPARATOR_ID = np.iinfo(np.uint32).max  # never a real id: vocabularies are far smaller


def fast_path_reason(tok: Tokenizer) -> str | None:
    """Why `tok` cannot use the ASCII fast path, or None when it can."""
    return _reason(json.loads(tok.to_str()))


def _reason(spec: dict[str, Any]) -> str | None:
    """`fast_path_reason` on a tokenizer's parsed `tokenizer.json`."""
    model, pre, norm = spec.get("model") or {}, spec.get("pre_tokenizer") or {}, spec["normalizer"]
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0.0):
        return "the model is not a BPE without dropout"
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex") or pre.get("add_prefix_space"):
        return "the pre-tokenizer is not ByteLevel(use_regex=True, add_prefix_space=False)"
    if norm is not None and norm.get("type") != "Lowercase":
        return f"the normalizer {norm.get('type')} is neither absent nor Lowercase"
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "the tokenizer truncates or pads"
    return None


class SegmentEncoder:
    """Encodes text segments without special tokens, as `Tokenizer.encode_batch_fast` does.

    `encode` returns the ids of all segments in one flat array and the number of ids of each.
    For byte-level BPE tokenizers (see the module docstring) ASCII segments are split by
    `ASCII_SPLIT` and each distinct word is encoded once; `cache_words` bounds the words kept
    between calls (the cache is emptied when it is full). `fast=False` always uses `tokenizers`.
    """

    def __init__(self, tok: Tokenizer, fast: bool = True, cache_words: int = 500_000) -> None:
        self.tok = tok
        spec: dict[str, Any] = json.loads(tok.to_str())
        self.reason = _reason(spec) if fast else "the fast path is switched off"
        self.cache_words = cache_words
        self.fast_segments = 0
        self.slow_segments = 0
        self._cache: dict[str, tuple[int, ...]] = {}
        if self.reason is None:
            self._lower = spec["normalizer"] is not None
            # The byte table comes from the tokenizer's own pre-tokenizer, one character each.
            pre = tok.pre_tokenizer
            assert pre is not None  # fast_path_reason saw a ByteLevel pre-tokenizer
            self._bytes = str.maketrans(
                {chr(b): pre.pre_tokenize_str(chr(b))[0][0] for b in range(1, 128)}
            )
            self._model = Tokenizer(tok.model)  # the BPE alone: one input string is one word
            added = sorted({a["content"] for a in spec["added_tokens"]}, key=len, reverse=True)
            pattern = "|".join(map(re.escape, added))
            self._added = re.compile(pattern, re.IGNORECASE) if added else None

    @property
    def fast(self) -> bool:
        """Whether this tokenizer takes the fast path."""
        return self.reason is None

    def encode(self, segments: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Ids of `segments` (uint32, concatenated) and the id count of each (int64)."""
        fast = [i for i, s in enumerate(segments) if s.isascii()] if self.reason is None else []
        joined = _SEPARATOR.join(segments[i] for i in fast)
        if fast and (
            joined.count(_SEPARATOR) != len(fast) - 1
            or (self._added is not None and self._added.search(joined))
        ):
            fast = [i for i in fast if self._clean(segments[i])]
            joined = _SEPARATOR.join(segments[i] for i in fast)
        in_fast = np.zeros(len(segments), dtype=bool)
        in_fast[fast] = True
        slow = np.flatnonzero(~in_fast)
        self.fast_segments += len(fast)
        self.slow_segments += len(slow)
        fast_ids, fast_lengths = self._encode_ascii(joined, len(fast))
        rest = [segments[i] for i in slow]
        encodings = self.tok.encode_batch_fast(rest, add_special_tokens=False)
        slow_lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))
        slow_ids = np.fromiter(
            chain.from_iterable(e.ids for e in encodings), np.uint32, int(slow_lengths.sum())
        )
        if not len(slow):
            return fast_ids, fast_lengths
        if not fast:
            return slow_ids, slow_lengths
        lengths = np.empty(len(segments), dtype=np.int64)
        lengths[in_fast] = fast_lengths
        lengths[slow] = slow_lengths
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        flat = np.empty(int(lengths.sum()), dtype=np.uint32)
        for ids, part_lengths, rows in (
            (fast_ids, fast_lengths, np.flatnonzero(in_fast)),
            (slow_ids, slow_lengths, slow),
        ):
            source_starts = np.concatenate([[0], np.cumsum(part_lengths)[:-1]])
            shift = np.repeat(starts[rows] - source_starts, part_lengths)
            flat[np.arange(len(ids)) + shift] = ids
        return flat, lengths

    def _clean(self, segment: str) -> bool:
        """Whether an ASCII segment holds neither the separator nor an added token's text."""
        if _SEPARATOR in segment:
            return False
        return self._added is None or self._added.search(segment) is None

    def _encode_ascii(self, joined: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Encode `count` separator-joined ASCII segments word by word."""
        if count == 0:
            return np.empty(0, np.uint32), np.empty(0, np.int64)
        if self._lower:
            joined = joined.lower()
        words = ASCII_SPLIT.findall(joined)
        cache = self._cache
        new = set(words).difference(cache)
        if len(cache) + len(new) > self.cache_words:
            cache.clear()
            new = set(words)
        new.discard(_SEPARATOR)
        cache[_SEPARATOR] = (int(_SEPARATOR_ID),)
        if new:
            order = list(new)
            mapped = [w.translate(self._bytes) for w in order]
            encodings = self._model.encode_batch_fast(mapped, add_special_tokens=False)
            cache.update(zip(order, (tuple(e.ids) for e in encodings), strict=True))
        ids = np.fromiter(chain.from_iterable(map(cache.__getitem__, words)), np.uint32)
        cuts = np.flatnonzero(ids == _SEPARATOR_ID)
        bounds = np.concatenate([[-1], cuts, [len(ids)]])
        lengths = np.diff(bounds) - 1
        return np.delete(ids, cuts), lengths.astype(np.int64)
