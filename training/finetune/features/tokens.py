"""Token classification: word-level BIO tags to sub-word labels, and predictions back to words.

Here: `featurize_token_classification` (words joined by single spaces and tokenized as running
text, so every vocabulary sees words as it saw them in pretraining; each piece is mapped to
its word through the character offsets; the first piece of a word carries the word's tag and
the other pieces -100, or with `label_all_tokens` the word's tag with B- turned into I-; long
sentences become overlapping windows) and `word_predictions` (piece logits of all windows back
to one tag string per word, for seqeval). Not here: the metrics
(`training/scoring/metrics/metrics.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from tasks.common.schema import TAGS, TOKENS, require_columns
from training.finetune.features.base import (
    IGNORE_INDEX,
    FeatureConfig,
    FeatureError,
    Features,
    apply_policy,
    encode_windows,
    example_ids,
    kept_features,
    log_windows,
)


def inside_tags(tag_names: Sequence[str]) -> np.ndarray:
    """For each tag index, the tag that continues it: I-X for B-X (when I-X exists), else itself."""
    index = {name: i for i, name in enumerate(tag_names)}
    return np.asarray(
        [
            index.get("I-" + name[2:], i) if name.startswith("B-") else i
            for i, name in enumerate(tag_names)
        ],
        dtype=np.int64,
    )


def _join(words: list[str]) -> tuple[str, np.ndarray, np.ndarray]:
    """The words as one text joined by spaces, with each word's (start, end) characters."""
    lengths = np.asarray([len(word) for word in words], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]]).astype(np.int64)
    return " ".join(words), starts, starts + lengths


def _piece_words(
    offsets: list[tuple[int, int]],
    sequence_ids: list[int | None],
    starts: np.ndarray,
    ends: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The word of each piece (-1 for specials) and whether it is its word's first piece.

    A piece belongs to the first word ending after the piece starts: a byte-level "Ġword" or
    Metaspace "▁word" piece starts on the space before its word. The first piece of a word is
    the first one of the window that starts at or before the word; a window that opens in the
    middle of a word has no first piece for it (its earlier window does).
    """
    span = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    text = np.asarray([s == 0 for s in sequence_ids], dtype=bool)
    if len(ends) == 0:
        return np.full(len(span), -1, np.int64), np.zeros(len(span), bool)
    word = np.searchsorted(ends, span[:, 0], side="right").clip(max=len(ends) - 1)
    word = np.where(text, word, -1)
    previous = np.concatenate([[-1], word[:-1]])
    first = text & (word != previous) & (span[:, 0] <= starts[word.clip(min=0)])
    return word, first


def _labels(
    word: np.ndarray, first: np.ndarray, gold: np.ndarray, inside: np.ndarray, all_pieces: bool
) -> np.ndarray:
    """Piece labels: the word's tag on its first piece; -100 (or the inside tag) elsewhere."""
    label = np.full(len(word), IGNORE_INDEX, dtype=np.int64)
    label[first] = gold[word[first]]
    if all_pieces:
        rest = (word >= 0) & ~first
        label[rest] = inside[gold[word[rest]]]
    return label


def _tags(
    table: pa.Table, ids: list[str], num_tags: int
) -> tuple[list[list[str]], list[list[int]]]:
    """The words and tag indexes, checked: one tag per word, every tag known."""
    words = table.column(TOKENS).to_pylist()
    tags = table.column(TAGS).to_pylist()
    for example_id, w, t in zip(ids, words, tags, strict=True):
        if len(w) != len(t):
            raise FeatureError(f"example {example_id!r}: {len(w)} {TOKENS!r} but {len(t)} {TAGS!r}")
        if any(not 0 <= tag < num_tags for tag in t):
            raise FeatureError(
                f"example {example_id!r}: column {TAGS!r} has a tag outside 0..{num_tags - 1}"
            )
    return words, tags


def featurize_token_classification(
    table: pa.Table,
    tokenizer: PreTrainedTokenizerBase,
    cfg: FeatureConfig,
    tag_names: Sequence[str],
) -> Features:
    """Features of a token-classification table (`tokens`, `tags` = indexes into `tag_names`).

    Labels: the first piece of each word gets the word's tag, every other piece and every
    special token -100 (with `cfg.label_all_tokens`, later pieces get the tag too, B-X as I-X).
    `Features.word_index` keeps each first piece's word for `word_predictions`.
    """
    require_columns(table, TOKENS, TAGS)
    ids = example_ids(table)
    words, tags = _tags(table, ids, len(tag_names))
    joined = [_join(w) for w in words]
    windows = encode_windows(tokenizer, [j[0] for j in joined], None, "only_first", cfg, True)
    assert windows.offsets is not None  # asked for above
    keep = apply_policy(windows, ids, cfg)
    inside, labels, word_index = inside_tags(tag_names), [], []
    for w in np.flatnonzero(keep):
        _, starts, ends = joined[windows.sample[w]]
        word, first = _piece_words(windows.offsets[w], windows.sequence_ids[w], starts, ends)
        gold = np.asarray(tags[windows.sample[w]], dtype=np.int64)
        labels.append(_labels(word, first, gold, inside, cfg.label_all_tokens))
        word_index.append(np.where(first, word, -1))
    features = replace(
        kept_features(windows, keep, len(ids), {"labels": labels}),
        word_index=word_index,
        num_words=np.asarray([len(w) for w in words], dtype=np.int64),
    )
    log_windows("token_classification", features)
    return features


def word_predictions(
    features: Features, logits: Sequence[np.ndarray] | np.ndarray, tag_names: Sequence[str]
) -> list[list[str]]:
    """One predicted tag string per word of each example, from the pieces' logits.

    A word's prediction is the argmax of its first piece's logits, averaged over the windows
    that hold that first piece. A word no window saw (truncated away, or no piece at all)
    is predicted "O" (or the first tag where there is no "O"), so every sequence keeps its
    length for seqeval.

    Args:
        features: From `featurize_token_classification`.
        logits: Per feature a (T, C) array, or one right-padded (F, T, C) array.
        tag_names: Tag names in index order.
    """
    if features.word_index is None or features.num_words is None:
        raise ValueError("features are not token-classification features")
    if len(logits) != len(features):
        raise ValueError(f"{len(logits)} logit rows for {len(features)} features")
    width = len(tag_names)
    sums = [np.zeros((n, width)) for n in features.num_words]
    counts = [np.zeros(n) for n in features.num_words]
    for f, words in enumerate(features.word_index):
        example, mask = features.example_index[f], words >= 0
        piece_logits = np.asarray(logits[f], dtype=np.float64)[: len(words)]
        np.add.at(sums[example], words[mask], piece_logits[mask])
        np.add.at(counts[example], words[mask], 1)
    default = list(tag_names).index("O") if "O" in tag_names else 0
    out = []
    for total, seen in zip(sums, counts, strict=True):
        best = np.where(seen > 0, total.argmax(axis=1) if len(total) else [], default)
        out.append([tag_names[int(i)] for i in best])
    return out
