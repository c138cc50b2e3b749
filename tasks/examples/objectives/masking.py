"""BERT's masked-LM objective: which positions to predict, whole words, and 80/10/10.

Vectorised over a batch of rows, with the counter-based random numbers of `rng`, so the example
stage (static masking) and the training loop (dynamic masking) draw the same masks. Choosing the
maskable tokens, batching and turning arrays into tensors are the callers' jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.examples.objectives.rng import (
    STREAM_MLM_ACTION,
    STREAM_MLM_COUNT,
    STREAM_MLM_POSITIONS,
    STREAM_MLM_WORDS,
    BoolArray,
    IntArray,
    U64Array,
    bits_from_bases,
    check_keys,
    counter_uniform,
    first_by_priority,
    hash32,
    priorities,
    row_bases,
)

IGNORE_INDEX = -100  # the label of an unchosen position (PyTorch's cross-entropy ignore_index)
WordFamily = Literal["wordpiece", "bpe", "unigram", "char"]


class MaskConfig(BaseModel):
    """BERT masked-LM recipe: how many tokens to predict and what each chosen token becomes."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    masked_lm_prob: float = Field(
        0.15, ge=0.0, le=1.0, description="Share of a row's maskable tokens to predict."
    )
    max_predictions_per_seq: int = Field(
        80, ge=1, description="Cap on the predicted positions of one row."
    )
    mask_token_prob: float = Field(
        0.8, ge=0.0, le=1.0, description="Share of chosen positions replaced by the mask id."
    )
    random_token_prob: float = Field(
        0.1, ge=0.0, le=1.0, description="Share of chosen positions replaced by a random id."
    )
    whole_word: bool = Field(
        False, description="Choose whole words (all their pieces) instead of single tokens."
    )

    @model_validator(mode="after")
    def _shares_fit(self) -> MaskConfig:
        if self.mask_token_prob + self.random_token_prob > 1.0:
            raise ValueError("mask_token_prob + random_token_prob must not exceed 1")
        return self


@dataclass(frozen=True)
class MaskResult:
    """Masked ids, labels, and per-batch counts of one `mask_tokens` call."""

    input_ids: IntArray  # (N, L) same dtype as the input
    labels: npt.NDArray[np.int64]  # (N, L) original id where chosen, IGNORE_INDEX elsewhere
    chosen: int
    masked: int
    randomized: int
    kept: int
    maskable: int


def _choose_by_rank(
    keys: U64Array, candidates: BoolArray, count: npt.NDArray[np.int64], stream: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Return (rows, cols) of `count[i]` positions per row i, uniform among its `candidates`.

    Each position gets a uint32 priority: 31 - c random bits from `hash32` above its column
    (c = bits of the largest column), the top bit set off the candidates. Priorities in a
    row are distinct, so a sorted row starts with its candidates in random order and reads
    back their columns; the result is row by row, each row's positions in that order. Ties of
    the random bits fall to the lower column, which can favour it only when a tie straddles
    the cut: in about W / 2^(31 - c) of the rows (8e-6 at W = 128, 1e-4 at W = 512), for one
    position each.
    """
    n, width = candidates.shape
    col_bits = max(1, (width - 1).bit_length())
    if col_bits > 24:  # fewer than 7 random bits would tie often
        raise ValueError(f"rows of {width} tokens are too long to mask (at most 2**24)")
    prio = hash32(row_bases(keys, stream)[:, None], np.arange(width)[None, :])  # (N, W)
    prio &= np.uint32(0x7FFFFFFF & ~((1 << col_bits) - 1))  # the random bits, top bit clear
    prio |= np.arange(width, dtype=np.uint32)
    # Set the top bit off the candidates: a shift of 0/1 beats a masked ufunc 3:1.
    prio |= (~candidates).astype(np.uint32) << np.uint32(31)
    prio.sort(axis=1)  # NumPy's SIMD sort; on 32-bit lanes twice as fast as on 64
    kmax = int(count.max(initial=0))
    head = prio[:, :kmax][np.arange(kmax) < count[:, None]]  # (M,) row by row
    cols = (head & np.uint32((1 << col_bits) - 1)).astype(np.intp)
    return np.repeat(np.arange(n), count), cols


def num_to_predict(
    n_maskable: npt.ArrayLike, keys: npt.ArrayLike, cfg: MaskConfig
) -> npt.NDArray[np.int64]:
    """Return each row's count of positions to predict: min(cap, max(1, n * p rounded)).

    BERT rounds n * p to the nearest integer, which biases the mask rate of short rows (at 20
    maskable tokens 3.0 is exact, but at 23 it gives 3 = 13%). Here n * p is rounded up with
    probability equal to its fraction (a counter draw per row), so the expected count is
    exactly n * p between 1 and the cap, and a row's count still differs from it by < 1.
    An empty row predicts nothing.
    """
    n = np.asarray(n_maskable, dtype=np.int64)  # (N,)
    u = counter_uniform(check_keys(keys, n.shape[0]), 1, STREAM_MLM_COUNT)[:, 0]  # (N,)
    want = np.floor(n * cfg.masked_lm_prob + u).astype(np.int64)  # (N,)
    k = np.minimum(cfg.max_predictions_per_seq, np.maximum(1, want))
    return np.where(n > 0, k, 0)


def _greedy_fill(sizes: npt.NDArray[np.int64], budget: npt.NDArray[np.int64]) -> BoolArray:
    """Apply BERT's whole-word rule to words in random order: take a word if it fits, else skip.

    `sizes` (N, W) holds the pieces of each row's words in visiting order (0 = no word).
    A round takes, from each row's cursor on, the longest run of fitting words whose total
    fits, then moves the cursor past the first fitting word that overflowed. After round
    one the budget left is below that word's size and every round takes a word, so the
    loop runs at most (longest word in pieces) + 1 times, typically 2-4.
    """
    n, width = sizes.shape
    taken = np.zeros((n, width), dtype=bool)
    left = budget.astype(np.int64)  # (N,)
    cursor = np.zeros(n, dtype=np.int64)
    cols = np.arange(width)
    while True:
        cand = (sizes > 0) & (sizes <= left[:, None]) & (cols >= cursor[:, None])  # (N, W)
        if not cand.any():
            return taken
        fill = np.cumsum(np.where(cand, sizes, 0), axis=1)  # (N, W)
        take = cand & (fill <= left[:, None])
        over = cand & ~take
        taken |= take
        left = left - np.where(take, sizes, 0).sum(axis=1)
        cursor = np.where(over.any(axis=1), over.argmax(axis=1) + 1, width)


def _choose_whole_words(
    maskable: BoolArray, word_starts: BoolArray, keys: U64Array, k: npt.NDArray[np.int64]
) -> BoolArray:
    """Return (N, L) True on every piece of the words that BERT's rule picks per row."""
    n, length = maskable.shape
    prev = np.zeros_like(maskable)
    prev[:, 1:] = maskable[:, :-1]
    starts = maskable & (word_starts | ~prev)  # a non-maskable token ends a word
    # int32: NumPy's cumsum of bool is ~8x faster into int32 than into the default int64.
    word_id = np.cumsum(starts, axis=1, dtype=np.int32) - 1  # (N, L) word index in the row
    flat = (np.arange(n)[:, None] * length + word_id)[maskable]
    sizes = np.bincount(flat, minlength=n * length).reshape(n, length)  # (N, L) by word id
    num_words = starts.sum(axis=1)  # (N,)
    prio = priorities(keys, length, STREAM_MLM_WORDS, starts)
    order, valid = first_by_priority(prio, num_words)  # (N, W) word starts in random order
    order_wid = np.take_along_axis(word_id, order, axis=1)  # (N, W)
    order_sizes = np.where(valid, np.take_along_axis(sizes, np.maximum(order_wid, 0), 1), 0)
    taken = _greedy_fill(order_sizes, k)  # (N, W)
    word_taken = np.zeros((n, length), dtype=bool)  # (N, L) by word id
    word_taken[np.nonzero(taken)[0], order_wid[taken]] = True
    chosen: BoolArray = maskable & np.take_along_axis(word_taken, np.maximum(word_id, 0), axis=1)
    return chosen


def mask_tokens(
    input_ids: npt.ArrayLike,
    maskable: npt.ArrayLike,
    word_starts: npt.ArrayLike | None,
    keys: npt.ArrayLike,
    cfg: MaskConfig,
    mask_id: int,
    random_ids: npt.ArrayLike,
) -> MaskResult:
    """Choose positions to predict per row and apply BERT's 80/10/10 replacement.

    Each row predicts `num_to_predict` positions (maskable * masked_lm_prob, rounded up or
    down at random so that the rate is unbiased, at least 1, at most the cap), chosen
    uniformly among its maskable ones (whole words with `cfg.whole_word`); each chosen
    position independently becomes `mask_id`, a uniform draw from `random_ids`, or stays.

    Args:
        input_ids: (N, L) token ids.
        maskable: (N, L) False for special tokens and padding, which are never chosen.
        word_starts: (N, L) True where a token begins a word; needed only for whole words.
        keys: (N,) uint64 keys from `sample_keys`.
        cfg: The masking recipe.
        mask_id: The id of the mask token.
        random_ids: 1-D ids a random replacement is drawn from (the non-special vocabulary).

    Returns:
        The masked ids, the labels and the per-batch counts.
    """
    ids = np.asarray(input_ids)
    can = np.asarray(maskable, dtype=bool)
    if ids.ndim != 2 or ids.shape != can.shape or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids {ids.shape} and maskable {can.shape} must be (N, L) ints")
    k_rows = check_keys(keys, ids.shape[0])
    pool = np.asarray(random_ids).reshape(-1)
    n_maskable = can.sum(axis=1)  # (N,)
    k = num_to_predict(n_maskable, k_rows, cfg)  # (N,)
    if cfg.whole_word:
        if word_starts is None:
            raise ValueError("whole-word masking needs word_starts")
        starts = np.asarray(word_starts, dtype=bool)
        if starts.shape != can.shape:
            raise ValueError(f"word_starts {starts.shape} must match input_ids {ids.shape}")
        chosen = _choose_whole_words(can, starts, k_rows, k)
        rows, cols = np.divmod(np.flatnonzero(chosen), ids.shape[1])  # 2-D nonzero: slower
    else:
        rows, cols = _choose_by_rank(k_rows, can, k, STREAM_MLM_POSITIONS)  # (M,) each
    out, labels, n_mask, n_rand = _replace_chosen(ids, rows, cols, k_rows, cfg, mask_id, pool)
    return MaskResult(
        input_ids=out,
        labels=labels,
        chosen=int(rows.size),
        masked=n_mask,
        randomized=n_rand,
        kept=int(rows.size) - n_mask - n_rand,
        maskable=int(n_maskable.sum()),
    )


def _replace_chosen(
    ids: IntArray,
    rows: npt.NDArray[np.intp],
    cols: npt.NDArray[np.intp],
    keys: U64Array,
    cfg: MaskConfig,
    mask_id: int,
    pool: IntArray,
) -> tuple[IntArray, npt.NDArray[np.int64], int, int]:
    """Apply 80/10/10 at the chosen (rows, cols) of `ids`.

    Returns the new ids, the labels, and how many positions were masked and randomised.
    """
    flat = rows * ids.shape[1] + cols  # (M,) into the row-major flat views
    # One splitmix64 draw per chosen position: its high half picks mask / random / keep, its
    # low half the random token; they are independent bits of one output.
    bits = bits_from_bases(row_bases(keys, STREAM_MLM_ACTION)[rows], cols)  # (M,)
    action = bits >> np.uint64(32)  # thresholds in 2^-32 steps, up to 2^32 (always)
    to_mask = action < np.uint64(cfg.mask_token_prob * 2**32)
    to_random = ~to_mask & (
        action < np.uint64((cfg.mask_token_prob + cfg.random_token_prob) * 2**32)
    )
    original = ids.reshape(-1)[flat]  # (M,)
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)  # (N, L)
    labels.reshape(-1)[flat] = original
    new = np.where(to_mask, np.asarray(mask_id, dtype=ids.dtype), original)
    if to_random.any():
        if pool.size == 0:
            raise ValueError("random_ids is empty but random replacement is enabled")
        # Lemire's multiply-shift maps the low 32 bits onto the pool; bias < len(pool) / 2^32.
        low = bits[to_random] & np.uint64(0xFFFFFFFF)
        new[to_random] = pool[((low * np.uint64(pool.size)) >> np.uint64(32)).astype(np.intp)]
    out = ids.copy()  # C order, so its flat view is the row-major one
    out.reshape(-1)[flat] = new
    return out, labels, int(np.count_nonzero(to_mask)), int(np.count_nonzero(to_random))


def word_start_table(tokens: list[str], family: WordFamily, special_ids: set[int]) -> BoolArray:
    """Return a (V,) lookup: True where vocabulary entry `id` begins a word.

    `wordpiece`: every token but a `##` continuation. `bpe` (byte-level, GPT-2/RoBERTa): a
    token led by `Ġ` (the byte-level space). `unigram` (SentencePiece): a token led by `▁`.
    Special tokens are always starts. For BPE and Unigram a word is therefore a
    whitespace-delimited unit (punctuation glued to a word belongs to it); a segment's first
    token has no leading space, so the caller must mark it as a start itself.

    Args:
        tokens: The vocabulary, `tokens[id]` being the token string of `id`.
        family: The tokenizer family that made the vocabulary.
        special_ids: Ids of special tokens.

    Raises:
        ValueError: an unknown family, or `char`, whose tokens carry no word boundary.
    """
    prefix = {"bpe": "Ġ", "unigram": "▁"}
    if family == "char":
        # A character token is the same whether it starts a word or not: no table can say.
        raise ValueError(
            "examples.mask.whole_word needs word boundaries in the vocabulary, and a "
            "tokenizer.family=char vocabulary (one token per character) has none: set "
            "examples.mask.whole_word=false"
        )
    if family == "wordpiece":
        table = np.array([not t.startswith("##") for t in tokens], dtype=bool)
    elif family in prefix:
        table = np.array([t.startswith(prefix[family]) for t in tokens], dtype=bool)
    else:
        raise ValueError(f"unknown tokenizer family {family!r}")
    specials = np.array(sorted(special_ids), dtype=np.int64)
    if specials.size and (specials.min() < 0 or specials.max() >= len(tokens)):
        raise ValueError("special_ids must be ids of the vocabulary")
    table[specials] = True
    return table
