"""BERT's and ALBERT's sentence pairs: the original `create_pretraining_data` recipe.

Consecutive sentences of a document become a pair A, B (IsNext), B a span of another document
(NotNext, bert) or A and B swapped (sop), laid out as `[CLS] A [SEP] B [SEP]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tasks.examples.config import ExamplesConfig
from tasks.examples.specials import Specials


@dataclass
class Pair:
    """One sentence pair before specials and masking."""

    a: np.ndarray
    b: np.ndarray
    label: int  # bert: 1 = NotNext (B is random); sop: 1 = swapped
    doc: int
    b_doc: int
    single: bool  # cut from a chunk of one segment (the recipe forces NotNext there)


RandomDoc = Callable[[np.random.Generator, int], tuple[int, list[np.ndarray]]]


def truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: np.random.Generator) -> None:
    """Cut the longer segment by one token at a time, from the front or the back at random."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def document_pairs(
    sentences: list[np.ndarray],
    doc: int,
    cfg: ExamplesConfig,
    rng: np.random.Generator,
    random_doc: RandomDoc,
) -> list[Pair]:
    """Cut one document into sentence pairs, following the original BERT recipe.

    Consecutive sentences are accumulated up to a target length (`max_seq_length - 3`, or a
    random shorter one with `short_seq_prob`); A is a random prefix of the chunk; B is the rest
    (IsNext) or, half the time and always when the chunk holds one segment, a span of another
    document (NotNext), whose unused sentences go back to be used next. For `sop`, B always
    follows A in the same document and the pair is swapped half the time.
    """
    max_tokens = cfg.max_seq_length - 3
    target = max_tokens
    if rng.random() < cfg.short_seq_prob:
        target = int(rng.integers(2, max_tokens + 1))
    pairs: list[Pair] = []
    chunk: list[np.ndarray] = []
    length = 0
    i = 0
    while i < len(sentences):
        chunk.append(sentences[i])
        length += len(sentences[i])
        if i == len(sentences) - 1 or length >= target:
            pair = _pair_from_chunk(chunk, doc, target, max_tokens, cfg, rng, random_doc)
            if pair is not None:
                pairs.append(pair[0])
                i -= pair[1]  # unused sentences are put back
            chunk, length = [], 0
        i += 1
    return pairs


def _pair_from_chunk(
    chunk: list[np.ndarray],
    doc: int,
    target: int,
    max_tokens: int,
    cfg: ExamplesConfig,
    rng: np.random.Generator,
    random_doc: RandomDoc,
) -> tuple[Pair, int] | None:
    a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
    a = [int(t) for s in chunk[:a_end] for t in s]
    b: list[int] = []
    label, b_doc, unused = 0, doc, 0
    single = len(chunk) == 1
    if cfg.objective == "sop" or (cfg.next_sentence == "balanced" and single):
        if single:  # one segment: cut it in two at a random token
            if len(a) < 2:
                return None
            cut = int(rng.integers(1, len(a)))
            a, b = a[:cut], a[cut:]
        else:
            b = [int(t) for s in chunk[a_end:] for t in s]
        if cfg.objective == "sop" and rng.random() < 0.5:
            a, b, label = b, a, 1
        elif cfg.objective == "bert" and rng.random() < 0.5:
            b, label, b_doc = _random_span(rng, doc, target - len(a), random_doc)
    elif single or rng.random() < 0.5:
        b, label, b_doc = _random_span(rng, doc, target - len(a), random_doc)
        unused = len(chunk) - a_end
    else:
        b = [int(t) for s in chunk[a_end:] for t in s]
    truncate_pair(a, b, max_tokens, rng)
    if not a or not b:
        return None
    return Pair(np.asarray(a), np.asarray(b), label, doc, b_doc, single), unused


def _random_span(
    rng: np.random.Generator, doc: int, target_b: int, random_doc: RandomDoc
) -> tuple[list[int], int, int]:
    other, sentences = random_doc(rng, doc)
    b: list[int] = []
    start = int(rng.integers(0, len(sentences)))
    for sentence in sentences[start:]:
        b.extend(int(t) for t in sentence)
        if len(b) >= target_b:
            break
    return b, 1, other


def pair_rows(
    pairs: list[Pair], sp: Specials, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lay pairs out as `[CLS] A [SEP] B [SEP]` padded to `length`.

    Returns ids (N, L), token type ids (N, L), real lengths (N,) and segment starts (N, L), True
    at the first token of A and of B (word starts for whole-word masking).
    """
    assert sp.cls is not None
    assert sp.sep is not None
    n = len(pairs)
    ids = np.full((n, length), sp.pad, dtype=np.int64)  # (N, L)
    types = np.zeros((n, length), dtype=np.uint8)  # (N, L)
    starts = np.zeros((n, length), dtype=bool)  # (N, L)
    lengths = np.empty(n, dtype=np.int64)
    for row, pair in enumerate(pairs):
        la, lb = len(pair.a), len(pair.b)
        ids[row, 0] = sp.cls
        ids[row, 1 : 1 + la] = pair.a
        ids[row, 1 + la] = sp.sep
        ids[row, 2 + la : 2 + la + lb] = pair.b
        ids[row, 2 + la + lb] = sp.sep
        types[row, 2 + la : 3 + la + lb] = 1
        starts[row, [1, 2 + la]] = True
        lengths[row] = 3 + la + lb
    return ids, types, lengths, starts
