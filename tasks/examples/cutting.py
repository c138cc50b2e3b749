"""Cutting encoded documents into the sequences of each objective but the sentence pairs.

RoBERTa's full sentences (across documents), BART's chunks of whole sentences (within one), GPT's
causal blocks, and T5's raw chunks with their length arithmetic. Each returns arrays; masking and
noise are the objectives' (`tasks.examples.objectives`), Arrow tables `tasks.examples.examples`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tasks.examples.config import ExamplesConfig
from tasks.examples.documents import EncodedDocs
from tasks.examples.objectives.spans import random_spans_helper


def full_sentences(docs: EncodedDocs, max_tokens: int, sep: int) -> list[np.ndarray]:
    """Pack contiguous sentences into sequences of at most `max_tokens` ids (RoBERTa).

    Sentences are taken in order and may cross documents, with `sep` between two documents; a
    sentence longer than `max_tokens` is cut into pieces.
    """
    out: list[np.ndarray] = []
    current: list[np.ndarray] = []
    length = 0

    def flush() -> None:
        nonlocal current, length
        if current:
            out.append(np.concatenate(current))
        current, length = [], 0

    separator = np.asarray([sep], dtype=docs.ids.dtype)
    for d in range(docs.documents):
        if d > 0 and length:
            if length + 1 > max_tokens:
                flush()
            else:
                current.append(separator)
                length += 1
        for sentence in docs.sentences(d):
            for at in range(0, len(sentence), max_tokens):
                part = sentence[at : at + max_tokens]
                if length + len(part) > max_tokens:
                    flush()
                current.append(part)
                length += len(part)
    flush()
    return out


def single_rows(
    sequences: list[np.ndarray], first: int, last: int, pad: int, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay sequences out as `first x last` padded to `length`: ids (N, L), lengths, starts."""
    n = len(sequences)
    ids = np.full((n, length), pad, dtype=np.int64)  # (N, L)
    starts = np.zeros((n, length), dtype=bool)  # (N, L)
    lengths = np.empty(n, dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, 0] = first
        ids[row, 1 : 1 + len(seq)] = seq
        ids[row, 1 + len(seq)] = last
        starts[row, 1] = True
        lengths[row] = 2 + len(seq)
    return ids, starts, lengths


def sentence_chunks(docs: EncodedDocs, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Group each document's consecutive sentences into chunks of at most `max_tokens` ids.

    Unlike `full_sentences`, a chunk never crosses a document. A sentence longer than
    `max_tokens` is cut into pieces, each then a sentence of its own.

    Returns:
        (P, 2) [start, stop) ranges into `docs.ids`, one per sentence (or piece) in order, and
        (P,) the chunk number of each.
    """
    pieces: list[tuple[int, int]] = []
    chunk_of: list[int] = []
    chunk = -1
    for d in range(docs.documents):
        length = max_tokens  # full: a document's first sentence opens a new chunk
        for s in range(int(docs.doc_offsets[d]), int(docs.doc_offsets[d + 1])):
            lo, hi = int(docs.sent_offsets[s]), int(docs.sent_offsets[s + 1])
            for at in range(lo, hi, max_tokens):
                stop = min(at + max_tokens, hi)
                if length + stop - at > max_tokens:
                    chunk, length = chunk + 1, 0
                pieces.append((at, stop))
                chunk_of.append(chunk)
                length += stop - at
    return np.asarray(pieces, dtype=np.int64).reshape(-1, 2), np.asarray(chunk_of, np.int64)


def sentence_rows(
    docs: EncodedDocs, length: int, first: int, last: int, pad: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay `sentence_chunks` out as `first sentences... last` padded to `length`.

    Returns ids (N, L) int64, sentence starts (N, L) bool (True at each sentence's first
    token) and real lengths (N,), specials included.
    """
    pieces, chunk = sentence_chunks(docs, length - 2)
    n = int(chunk[-1]) + 1 if len(chunk) else 0
    sizes = pieces[:, 1] - pieces[:, 0]  # (P,)
    before = np.cumsum(sizes) - sizes  # (P,) tokens of the earlier pieces
    content = np.bincount(chunk, weights=sizes, minlength=n).astype(np.int64)  # (N,)
    col = 1 + before - (np.cumsum(content) - content)[chunk]  # (P,) column in its row
    offset = np.arange(int(sizes.sum())) - np.repeat(before, sizes)  # (T,) inside its piece
    ids = np.full((n, length), pad, dtype=np.int64)  # (N, L)
    ids[np.repeat(chunk, sizes), np.repeat(col, sizes) + offset] = docs.ids[
        np.repeat(pieces[:, 0], sizes) + offset
    ]
    ids[:, 0] = first
    ids[np.arange(n), content + 1] = last
    starts = np.zeros((n, length), dtype=bool)  # (N, L)
    starts[chunk, col] = True
    return ids, starts, content + 2


def causal_blocks(
    docs: EncodedDocs, block_size: int, eot: int
) -> tuple[np.ndarray, pa.ListArray, int]:
    """Join documents, each followed by `eot`, and cut the stream into full blocks.

    Returns the blocks (B, block_size), for each block the positions where a document starts
    inside it (the position after an `eot`) as a `list<int32>` array, and the number of tail
    tokens dropped.
    """
    lengths = np.diff(docs.sent_offsets[docs.doc_offsets]) + 1  # (D,) with the eot
    ends = np.cumsum(lengths)  # (D,) stream position just after each eot
    stream = np.empty(int(ends[-1]) if len(ends) else 0, dtype=docs.ids.dtype)
    is_eot = np.zeros(len(stream), dtype=bool)
    if len(ends):
        is_eot[ends - 1] = True
        stream[is_eot] = eot
        stream[~is_eot] = docs.ids[: docs.sent_offsets[docs.doc_offsets[-1]]]
    n_blocks = len(stream) // block_size
    blocks = stream[: n_blocks * block_size].reshape(n_blocks, block_size)  # (B, L)
    starts = ends[ends < n_blocks * block_size]
    inside = starts[starts % block_size != 0]  # a start at offset 0 is no boundary
    per_block = np.bincount(inside // block_size, minlength=n_blocks)  # (B,)
    offsets = np.concatenate([[0], np.cumsum(per_block)]).astype(np.int32)  # (B + 1,)
    positions = pa.array((inside % block_size).astype(np.int32))
    starts_list = pa.ListArray.from_arrays(pa.array(offsets), positions)
    return blocks, starts_list, len(stream) - n_blocks * block_size


def t5_raw_length(cfg: ExamplesConfig) -> tuple[int, int]:
    """The raw tokens to take per example and the targets length (T5's length arithmetic)."""
    return random_spans_helper(
        cfg.max_seq_length, cfg.span.noise_density, cfg.span.mean_noise_span_length
    )


def raw_chunks(docs: EncodedDocs, raw_length: int) -> tuple[np.ndarray, int]:
    """Concatenate the documents (no separator, as T5 does) and cut chunks of `raw_length`.

    Returns the chunks (N, raw_length) and the number of tail tokens dropped.
    """
    stream = docs.ids[: docs.sent_offsets[docs.doc_offsets[-1]]] if docs.documents else docs.ids
    n = len(stream) // raw_length
    return stream[: n * raw_length].reshape(n, raw_length), len(stream) - n * raw_length
