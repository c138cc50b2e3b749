"""BART's denoising objective: sentence permutation and text infilling with Poisson spans.

Vectorised over a batch of rows `<s> ... </s>`, with the counter-based random numbers of `rng`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from tasks.examples.objectives.rng import (
    STREAM_DN_BUDGET,
    STREAM_DN_LAYOUT,
    STREAM_DN_LENGTHS,
    STREAM_DN_PERMUTE_ROW,
    STREAM_DN_RANDOM,
    STREAM_DN_SENTENCES,
    STREAM_DN_TOKEN,
    BoolArray,
    FloatArray,
    IntArray,
    U64Array,
    bits_at,
    check_keys,
    counter_uniform,
    first_by_priority,
    priorities,
    to_unit,
)


class DenoisingConfig(BaseModel):
    """BART denoising: sentence permutation, then text infilling with Poisson-length spans."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    mask_ratio: float = Field(
        0.3, ge=0.0, le=1.0, description="Share of a row's tokens (specials excluded) masked."
    )
    poisson_lambda: float = Field(
        3.0,
        gt=0.0,
        le=64.0,
        description="Span lengths ~ Poisson(lambda); a 0-length span inserts one mask token.",
    )
    permute_sentences: float = Field(
        1.0, ge=0.0, le=1.0, description="Share of rows whose sentences are shuffled (BART: all)."
    )
    replace_length: Literal[-1, 0, 1] = Field(
        1, description="Mask tokens per span: 1 = one, 0 = none (delete it), -1 = one per token."
    )
    random_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of mask tokens replaced by a random token."
    )


@dataclass(frozen=True)
class InfillResult:
    """Noised rows and per-row counts of one `text_infill` call."""

    input_ids: IntArray  # (N, L) `<s> noised </s>` then padding, same dtype as the input
    lengths: npt.NDArray[np.int64]  # (N,) real tokens of each noised row, specials included
    masked: BoolArray  # (N, L) True at the input positions that a span covers
    span_lengths: npt.NDArray[np.int64]  # (N, S) span lengths in drawn order, -1 after the last
    spans: npt.NDArray[np.int64]  # (N,) spans, 0-length ones included
    inserted: npt.NDArray[np.int64]  # (N,) 0-length spans (one mask token, nothing removed)
    masked_tokens: npt.NDArray[np.int64]  # (N,) input tokens that spans cover
    noise_tokens: npt.NDArray[np.int64]  # (N,) mask (or random) tokens written
    random_tokens: npt.NDArray[np.int64]  # (N,) of those, the random ones


def _poisson_cdf(lam: float) -> FloatArray:
    """Return the Poisson(lam) CDF at 0..K, with K far enough out that the tail is below 2^-53."""
    k = np.arange(math.ceil(lam + 12.0 * math.sqrt(lam) + 24.0) + 1)
    log_pmf = -lam + k * math.log(lam) - np.array([math.lgamma(i + 1.0) for i in k])
    return np.cumsum(np.exp(log_pmf))


def poisson_span_lengths(
    keys: npt.ArrayLike, budget: npt.ArrayLike, lam: float
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Draw Poisson(lam) span lengths per row until their running sum reaches the row's budget.

    Draw j of a row is the inverse CDF of the uniform at (key, j), so it never depends on the
    batch or on how many draws were made. As in fairseq, every draw up to the one that reaches
    the budget is a span; by Wald's identity those draws, pooled over rows, follow the pmf
    exactly in expectation (the caller trims the last one to the budget).

    Args:
        keys: (N,) uint64 keys from `sample_keys`.
        budget: (N,) non-negative tokens to cover per row.
        lam: The Poisson mean.

    Returns:
        (N, D) draws and (N,) the number of draws used: 0 for a zero budget, otherwise the
        index of the first running sum >= budget, plus one.
    """
    k = check_keys(keys)
    need = np.asarray(budget, dtype=np.int64).reshape(-1)
    if need.shape != k.shape or (need.size and int(need.min()) < 0):
        raise ValueError(f"budget must be (N,) non-negative for {k.shape[0]} keys")
    cdf = _poisson_cdf(lam)
    width = math.ceil(1.25 * int(need.max(initial=0)) / lam) + 8
    while True:  # a rare unlucky row doubles the width; earlier columns never change
        draws = np.searchsorted(cdf, counter_uniform(k, width, STREAM_DN_LENGTHS), side="right")
        total = np.cumsum(draws, axis=1)  # (N, D)
        if (total[:, -1] >= need).all():
            break
        width *= 2
    used = np.where(need > 0, (total < need[:, None]).sum(axis=1) + 1, 0)
    return draws.astype(np.int64), used.astype(np.int64)


def _check_rows(ids: IntArray, lengths: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Return `lengths` as (N,) int64 after checking rows `<s> ... </s>` fit in (N, L) `ids`."""
    lens = np.asarray(lengths, dtype=np.int64)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or lens.shape != ids.shape[:1]:
        raise ValueError(f"input_ids {ids.shape} must be (N, L) ints and lengths (N,)")
    if lens.size and (int(lens.min()) < 2 or int(lens.max()) > ids.shape[1]):
        raise ValueError(f"lengths must be in [2, {ids.shape[1]}]: <s> and </s> included")
    return lens


def permute_sentences(
    input_ids: npt.ArrayLike,
    sentence_starts: npt.ArrayLike,
    lengths: npt.ArrayLike,
    keys: npt.ArrayLike,
    cfg: DenoisingConfig,
) -> tuple[IntArray, BoolArray]:
    """Shuffle the sentences of a `cfg.permute_sentences` share of rows `<s> ... </s>`.

    A chosen row's sentences are put in a uniformly random order (the identity included, as
    in BART); `<s>`, `</s>` and the padding stay where they are.

    Args:
        input_ids: (N, L) rows: `<s>` at 0, `</s>` at `lengths - 1`, padding after.
        sentence_starts: (N, L) True at the first token of each sentence; position 1 always
            starts one.
        lengths: (N,) real tokens per row, specials included.
        keys: (N,) uint64 keys from `sample_keys`.
        cfg: The denoising recipe.

    Returns:
        The rows with their sentences shuffled, and (N,) True where a row with at least two
        sentences was shuffled.
    """
    ids = np.asarray(input_ids)
    lens = _check_rows(ids, lengths)
    starts = np.asarray(sentence_starts, dtype=bool)
    if starts.shape != ids.shape:
        raise ValueError(f"sentence_starts {starts.shape} must match input_ids {ids.shape}")
    n, width = ids.shape
    k = check_keys(keys, n)
    col = np.arange(width)[None, :]  # (1, L)
    inside = (col >= 1) & (col < lens[:, None] - 1)  # (N, L) between <s> and </s>
    first = inside & (starts | (col == 1))
    sentence = np.maximum(np.cumsum(first, axis=1, dtype=np.int32) - 1, 0)  # (N, L)
    count = first.sum(axis=1).astype(np.int64)  # (N,)
    chosen = counter_uniform(k, 1, STREAM_DN_PERMUTE_ROW)[:, 0] < cfg.permute_sentences
    prio = priorities(k, width, STREAM_DN_SENTENCES, col < count[:, None])
    order, valid = first_by_priority(prio, np.where(chosen, count, 0))  # (N, K) new order
    rank = np.broadcast_to(np.arange(width, dtype=np.int64), (n, width)).copy()  # (N, S)
    rows, slots = np.nonzero(valid)
    rank[rows, order[rows, slots]] = slots
    # Sort key: sentence rank, then position (tokens of a sentence stay in order); specials
    # and padding keep their places.
    key = np.take_along_axis(rank, sentence, axis=1) * width + col  # (N, L)
    key = np.where(col == 0, -1, np.where(inside, key, width * width + col))
    out = np.take_along_axis(ids, np.argsort(key, axis=1, kind="stable"), axis=1)
    return out, chosen & (count >= 2)


def _span_layout(
    keys: U64Array, content: npt.NDArray[np.int64], width: int, cfg: DenoisingConfig
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Return each row's budget, its spans (N, S) in drawn order (-1 after), and their count.

    Draws stop at the budget and the last span is trimmed to it. 0-length spans that would
    push the noised row past `width` content tokens are dropped (only rows with no room left
    lose any, e.g. with `replace_length=-1`).
    """
    u = counter_uniform(keys, 1, STREAM_DN_BUDGET)[:, 0]  # (N,)
    # Rounded up with probability equal to the fraction: the expected budget is exact.
    budget = np.minimum(content, np.floor(content * cfg.mask_ratio + u).astype(np.int64))
    draws, used = poisson_span_lengths(keys, budget, cfg.poisson_lambda)  # (N, D), (N,)
    before = np.cumsum(draws, axis=1) - draws  # (N, D) tokens covered by earlier spans
    taken = np.arange(draws.shape[1])[None, :] < used[:, None]
    length = np.where(taken, np.minimum(draws, budget[:, None] - before), -1)  # (N, D)
    zero = length == 0
    nonzero = (length > 0).sum(axis=1)
    out_tokens = {1: content - budget + nonzero, 0: content - budget, -1: content}
    room = width - out_tokens[cfg.replace_length]  # (N,) >= 0
    length = np.where(zero & (np.cumsum(zero, axis=1) > room[:, None]), -1, length)
    kept = length >= 0
    count = kept.sum(axis=1).astype(np.int64)  # (N,)
    spans = np.full((len(count), max(1, int(count.max(initial=0)))), -1, dtype=np.int64)
    rows, _ = np.nonzero(kept)
    spans[rows, (np.cumsum(kept, axis=1) - 1)[kept]] = length[kept]
    return budget, spans, count


def text_infill(
    input_ids: npt.ArrayLike,
    lengths: npt.ArrayLike,
    keys: npt.ArrayLike,
    cfg: DenoisingConfig,
    mask_id: int,
    pad_id: int,
    random_ids: npt.ArrayLike,
) -> InfillResult:
    """Apply BART's text infilling to rows `<s> ... </s>`: Poisson spans become mask tokens.

    Each row covers `content * mask_ratio` tokens (rounded up or down at random, unbiased)
    with spans whose lengths are Poisson(`poisson_lambda`) draws, the last trimmed to fit.
    The spans, 0-length ones included, are placed uniformly at random among the kept tokens,
    never overlapping and never over `<s>` or `</s>`. A span becomes one mask token
    (`replace_length=1`), nothing (0) or one per token (-1); a 0-length span always inserts
    one. Each mask token is a uniform draw from `random_ids` with probability `random_ratio`.

    Args:
        input_ids: (N, L) rows: `<s>` at 0, `</s>` at `lengths - 1`, padding after.
        lengths: (N,) real tokens per row, specials included.
        keys: (N,) uint64 keys from `sample_keys`.
        cfg: The denoising recipe.
        mask_id: The id of the mask token.
        pad_id: The id that fills each noised row after its `</s>`.
        random_ids: 1-D ids a random replacement is drawn from (the non-special vocabulary).

    Returns:
        The noised rows (same width; never longer than L) and per-row counts.
    """
    ids = np.asarray(input_ids)
    lens = _check_rows(ids, lengths)
    n, width = ids.shape
    k = check_keys(keys, n)
    content = lens - 2  # (N,) tokens between <s> and </s>
    budget, spans, count = _span_layout(k, content, width - 2, cfg)
    items = content - budget + count  # (N,) <= width - 2 unless replace_length=0
    real, is_span, span_len = _order_items(k, items, count, spans, width)
    consumed = np.where(is_span, span_len, real)  # (N, T) input tokens per item
    written = {
        1: real.astype(np.int64),
        0: np.where(is_span, span_len == 0, real),
        -1: np.where(is_span, np.maximum(span_len, 1), real),
    }[cfg.replace_length].astype(np.int64)  # (N, T) output tokens per item
    src = 1 + np.cumsum(consumed, axis=1) - consumed  # (N, T) first input position
    out, out_len = _frame(ids, lens, written, pad_id)
    rows, cols = _write_items(out, ids, src, written, is_span, mask_id)  # the mask tokens
    random = _randomize(out, rows, cols, k, cfg.random_ratio, random_ids)
    return InfillResult(
        input_ids=out,
        lengths=out_len,
        masked=_covered(is_span & (span_len > 0), src, span_len, width),
        span_lengths=spans[:, : int(count.max(initial=0))],
        spans=count,
        inserted=(spans == 0).sum(axis=1).astype(np.int64),
        masked_tokens=budget,
        noise_tokens=np.bincount(rows, minlength=n).astype(np.int64),
        random_tokens=random,
    )


def _order_items(
    keys: U64Array,
    items: npt.NDArray[np.int64],
    count: npt.NDArray[np.int64],
    spans: npt.NDArray[np.int64],
    width: int,
) -> tuple[BoolArray, BoolArray, npt.NDArray[np.int64]]:
    """Put each row's items in a random order; return (N, T) real, is-span and span length.

    A row is a sequence of `items` items: its kept tokens, in order, and its `count` spans. A
    random order of all the items places the spans (items < count) uniformly among the kept
    tokens.
    """
    # At least `width` columns, whatever the batch: a row's order then depends on its key only.
    cols = np.arange(max(width, int(items.max(initial=0))))[None, :]
    prio = priorities(keys, cols.shape[1], STREAM_DN_LAYOUT, cols < items[:, None])
    order, real = first_by_priority(prio, items)  # (N, T) item ids in row order
    is_span = real & (order < count[:, None])
    span_len = np.take_along_axis(spans, np.where(is_span, order, 0), axis=1)  # (N, T)
    return real, is_span, span_len


def _frame(
    ids: IntArray, lens: npt.NDArray[np.int64], written: npt.NDArray[np.int64], pad_id: int
) -> tuple[IntArray, npt.NDArray[np.int64]]:
    """Return the noised rows holding only `<s>`, `</s>` and padding, and their (N,) lengths."""
    n = ids.shape[0]
    out_len = written.sum(axis=1) + 2  # (N,)
    out = np.full_like(ids, pad_id)
    out[:, :1] = ids[:, :1]
    out[np.arange(n), out_len - 1] = ids[np.arange(n), lens - 1]
    return out, out_len


def _write_items(
    out: IntArray,
    ids: IntArray,
    src: npt.NDArray[np.int64],
    written: npt.NDArray[np.int64],
    is_span: BoolArray,
    mask_id: int,
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Write each item's `written` tokens after `<s>` in place; return the mask positions.

    A kept token copies `ids` at its input position `src`; a span writes mask tokens.
    """
    dst = 1 + np.cumsum(written, axis=1) - written  # (N, T) first output position
    rows, items = np.nonzero(written)
    reps = written[rows, items]  # (M,) output tokens of each item
    r_tok = np.repeat(rows, reps)  # (W,) one per output token
    offset = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
    c_tok = np.repeat(dst[rows, items], reps) + offset  # (W,)
    noise = np.repeat(is_span[rows, items], reps)  # (W,)
    source = ids[r_tok, np.repeat(src[rows, items], reps)]
    out[r_tok, c_tok] = np.where(noise, np.asarray(mask_id, dtype=ids.dtype), source)
    return r_tok[noise], c_tok[noise]


def _randomize(
    out: IntArray,
    rows: npt.NDArray[np.intp],
    cols: npt.NDArray[np.intp],
    keys: U64Array,
    ratio: float,
    random_ids: npt.ArrayLike,
) -> npt.NDArray[np.int64]:
    """Replace a `ratio` share of the mask tokens at (rows, cols) by random ids, in place.

    Returns (N,) the random tokens per row.
    """
    pick = to_unit(bits_at(keys[rows], STREAM_DN_RANDOM, cols)) < ratio
    r_rows, r_cols = rows[pick], cols[pick]
    if r_rows.size:
        pool = np.asarray(random_ids).reshape(-1)
        if pool.size == 0:
            raise ValueError("random_ids is empty but random_ratio > 0")
        draw = bits_at(keys[r_rows], STREAM_DN_TOKEN, r_cols) % np.uint64(pool.size)
        out[r_rows, r_cols] = pool[draw.astype(np.intp)]
    return np.bincount(r_rows, minlength=out.shape[0]).astype(np.int64)


def _covered(
    spans: BoolArray, src: npt.NDArray[np.int64], length: npt.NDArray[np.int64], width: int
) -> BoolArray:
    """Return (N, width) True inside the (non-overlapping) input ranges of the `spans` items."""
    rows, items = np.nonzero(spans)
    starts = np.zeros((spans.shape[0], width + 1), dtype=np.int32)
    ends = np.zeros_like(starts)
    starts[rows, src[rows, items]] = 1
    ends[rows, src[rows, items] + length[rows, items]] = 1
    covered: BoolArray = np.cumsum(starts - ends, axis=1)[:, :width] > 0
    return covered
