"""Vectorised NumPy cores of the pretraining objectives: BERT masking, T5 spans, BART noise.

Randomness is counter-based. A sample's key hashes (run seed, epoch, global sample index), and
every random number hashes (key, stream, position), so a sample gets the same mask in any
batch, worker or process and no generator state travels. Each decision (positions, 80/10/10
with its replacement token, word order, span layout) reads its own stream, so changing one
never shifts another. Nothing here reads files, the clock or the environment; choosing the maskable
tokens, batching and turning arrays into tensors are the callers' jobs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

U64Array = npt.NDArray[np.uint64]
U32Array = npt.NDArray[np.uint32]
IntArray = npt.NDArray[np.integer]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]

IGNORE_INDEX = -100  # the label of an unchosen position (PyTorch's cross-entropy ignore_index)
WordFamily = Literal["wordpiece", "bpe", "unigram"]

_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's odd increment, 2^64 / golden ratio
_SALT_SEED, _SALT_EPOCH, _SALT_INDEX, _SALT_STREAM = (
    0x243F6A8885A308D3,  # digits of pi: arbitrary, fixed, distinct salts
    0x13198A2E03707344,
    0xA4093822299F31D0,
    0x082EFA98EC4E6C89,
)
_NO_PRIORITY = np.uint64(np.iinfo(np.uint64).max)  # sorts after every real priority
_STREAM_MLM_POSITIONS, _STREAM_MLM_ACTION, _STREAM_MLM_WORDS = 1, 2, 4  # 3: retired
_STREAM_NOISE_CUTS, _STREAM_NONNOISE_CUTS = 5, 6
_STREAM_MLM_COUNT = 7
_STREAM_DN_BUDGET, _STREAM_DN_LENGTHS, _STREAM_DN_LAYOUT = 8, 9, 10
_STREAM_DN_RANDOM, _STREAM_DN_TOKEN = 11, 12
_STREAM_DN_PERMUTE_ROW, _STREAM_DN_SENTENCES = 13, 14


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


class SpanConfig(BaseModel):
    """T5 span corruption: how much of a row is noise and how long its spans are on average."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    noise_density: float = Field(
        0.15, ge=0.0, lt=1.0, description="Share of the raw tokens that are noise."
    )
    mean_noise_span_length: float = Field(
        3.0, ge=1.0, description="Mean length in tokens of a noise span."
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
class MaskResult:
    """Masked ids, labels, and per-batch counts of one `mask_tokens` call."""

    input_ids: IntArray  # (N, L) same dtype as the input
    labels: npt.NDArray[np.int64]  # (N, L) original id where chosen, IGNORE_INDEX elsewhere
    chosen: int
    masked: int
    randomized: int
    kept: int
    maskable: int


def _mix64(z: U64Array) -> U64Array:
    """Apply splitmix64's finaliser: a uint64 bijection in which every input bit flips ~half."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # uint64 arrays wrap mod 2^64
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _u64(value: int, name: str) -> U64Array:
    """Return `value` as a 1-element uint64 array (arrays wrap silently, scalars warn)."""
    if not 0 <= value < 2**64:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return np.array([value], dtype=np.uint64)


def sample_keys(seed: int, epoch: int, indices: npt.ArrayLike) -> U64Array:
    """Hash (run seed, epoch, global sample index) into one uint64 key per sample.

    Args:
        seed: The run seed, in [0, 2**64).
        epoch: The epoch, in [0, 2**64); a new epoch gives every sample fresh randomness.
        indices: (N,) non-negative integer global sample indices.

    Returns:
        (N,) uint64 keys; distinct indices under one (seed, epoch) give distinct keys.
    """
    idx = np.asarray(indices)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"indices must be a 1-D integer array, got {idx.dtype} {idx.shape}")
    if idx.size and int(idx.min()) < 0:
        raise ValueError("indices must be non-negative")
    head = _mix64(_u64(seed, "seed") + np.uint64(_SALT_SEED))  # (1,)
    head = _mix64(head ^ _mix64(_u64(epoch, "epoch") + np.uint64(_SALT_EPOCH)))
    # Mixing is a bijection, so keys under one (seed, epoch) never collide.
    return _mix64(head ^ _mix64(idx.astype(np.uint64) + np.uint64(_SALT_INDEX)))  # (N,)


def _check_keys(keys: npt.ArrayLike, rows: int | None = None) -> U64Array:
    """Return `keys` as a (N,) uint64 array; N must equal `rows` when given."""
    k = np.asarray(keys)
    if k.ndim != 1 or k.dtype != np.uint64:
        raise ValueError(f"keys must be a 1-D uint64 array from sample_keys, got {k.dtype}")
    if rows is not None and k.shape[0] != rows:
        raise ValueError(f"{k.shape[0]} keys for {rows} rows")
    return k


@functools.cache
def _stream_salt(stream: int) -> np.uint64:
    """Return the mixed salt of `stream` (a constant, so computed once per stream)."""
    salt: np.uint64 = _mix64(_u64(stream, "stream") + np.uint64(_SALT_STREAM))[0]
    return salt


def _row_bases(keys: U64Array, stream: int) -> U64Array:
    """Return the uint64 that seeds the (key, stream) sequence, per key."""
    return _mix64(keys ^ _stream_salt(stream))


def _bits_at(keys: U64Array, stream: int, cols: npt.NDArray[np.integer]) -> U64Array:
    """Return the random uint64 at (key, stream, col) for broadcast `keys` and `cols`.

    The (key, stream) pair seeds a splitmix64 sequence and `col` indexes into it, so any
    single value can be computed without the ones before it.
    """
    return _bits_from_bases(_row_bases(keys, stream), cols)


def _bits_from_bases(bases: U64Array, cols: npt.NDArray[np.integer]) -> U64Array:
    """Return `_bits_at` given the keys' `_row_bases` (mixed once per row, then gathered)."""
    return _mix64(bases + (cols.astype(np.uint64) + np.uint64(1)) * np.uint64(_GAMMA))


def counter_bits(keys: npt.ArrayLike, width: int, stream: int) -> U64Array:
    """Return (N, width) random uint64; [i, j] depends only on (keys[i], stream, j)."""
    k = _check_keys(keys)
    return _bits_at(k[:, None], stream, np.arange(width)[None, :])  # (N, width)


def _to_unit(bits: U64Array) -> FloatArray:
    """Map uint64 to float64 in [0, 1) with the top 53 bits (every value exact)."""
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def counter_uniform(keys: npt.ArrayLike, width: int, stream: int) -> FloatArray:
    """Return (N, width) float64 uniforms in [0, 1); [i, j] depends only on (keys[i], stream, j).

    Args:
        keys: (N,) uint64 keys from `sample_keys`.
        width: Values per row.
        stream: The purpose of the draw; different streams give independent values.
    """
    return _to_unit(counter_bits(keys, width, stream))


def _priorities(
    keys: U64Array, width: int, stream: int, candidates: BoolArray | None = None
) -> U64Array:
    """Return (N, width) random sort keys, distinct within a row, holding the column.

    The low bits are the column, so ties (and with them any dependence of an order on the
    sort algorithm or the batch) are impossible and a sorted row reads back its columns.
    The top bit is clear, so non-`candidates` (`_NO_PRIORITY`) sort strictly last.
    """
    low = (1 << max(1, (width - 1).bit_length())) - 1
    high = np.uint64((2**63 - 1) & ~low)
    prio = (counter_bits(keys, width, stream) & high) | np.arange(width, dtype=np.uint64)
    return prio if candidates is None else np.where(candidates, prio, _NO_PRIORITY)


def _first_by_priority(
    prio: U64Array, count: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.intp], BoolArray]:
    """Return the columns of each row's smallest priorities, in order, and which count.

    Returns (N, K) columns with K = max(count) and (N, K) `valid` = j < count[i]; invalid
    slots read column 0. NumPy's vectorised uint64 sort beats argpartition plus a gather.
    """
    low = np.uint64((1 << max(1, (prio.shape[1] - 1).bit_length())) - 1)
    kmax = int(count.max(initial=0))
    head = np.sort(prio, axis=1)[:, :kmax]  # (N, K)
    valid = np.arange(kmax) < count[:, None]  # (N, K)
    return np.where(valid, head & low, 0).astype(np.intp), valid


def _hash32(bases: U64Array, cols: npt.NDArray[np.integer]) -> U32Array:
    """Return the random uint32 at (row, col) for broadcast `_row_bases` and `cols`.

    A cheaper stream than `_bits_at` for the per-position priorities of `mask_tokens`:
    Wellons' `lowbias32` (a 32-bit xorshift-multiply finaliser, with a lower avalanche bias
    than MurmurHash3's) over a Weyl sequence, as many passes as splitmix64 but on 32-bit
    lanes: half the bytes, twice the SIMD lanes. It is a bijection, so a row's values are
    distinct; both halves of the row's 64-bit base enter every value, so two rows share a
    sequence only if their bases collide. A priority needs only its top bits to be uniform
    and independent across positions and rows (sanity-checked by `test_hash32_*`).
    """
    weyl = cols.astype(np.uint32) * np.uint32(0x9E3779B9)  # wraps mod 2^32
    x = (bases >> np.uint64(32)).astype(np.uint32) + weyl
    x ^= bases.astype(np.uint32)  # the low half
    # In place: fewer (N, W) temporaries, each of which costs page faults whenever the
    # allocator has handed freed memory back to the kernel (4x the time of the arithmetic).
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def _choose_by_rank(
    keys: U64Array, candidates: BoolArray, count: npt.NDArray[np.int64], stream: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Return (rows, cols) of `count[i]` positions per row i, uniform among its `candidates`.

    Each position gets a uint32 priority: 31 - c random bits from `_hash32` above its column
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
    prio = _hash32(_row_bases(keys, stream)[:, None], np.arange(width)[None, :])  # (N, W)
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
    u = counter_uniform(_check_keys(keys, n.shape[0]), 1, _STREAM_MLM_COUNT)[:, 0]  # (N,)
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
    prio = _priorities(keys, length, _STREAM_MLM_WORDS, starts)
    order, valid = _first_by_priority(prio, num_words)  # (N, W) word starts in random order
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
    k_rows = _check_keys(keys, ids.shape[0])
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
        rows, cols = _choose_by_rank(k_rows, can, k, _STREAM_MLM_POSITIONS)  # (M,) each
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
    bits = _bits_from_bases(_row_bases(keys, _STREAM_MLM_ACTION)[rows], cols)  # (M,)
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
    """
    prefix = {"bpe": "Ġ", "unigram": "▁"}
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


def random_spans_helper(
    inputs_length: int,
    noise_density: float,
    mean_noise_span_length: float,
    extra_tokens_per_span_inputs: int = 1,
    extra_tokens_per_span_targets: int = 1,
) -> tuple[int, int]:
    """Return (raw tokens length, targets length) that make span corruption fill `inputs_length`.

    T5's rule: grow the raw length from `inputs_length - 1` while the inputs it gives (kept
    tokens, one sentinel per noise span, EOS) still fit; the targets length (noise tokens,
    one sentinel per span, EOS) follows. Rounding is Python's (half to even).
    """
    if inputs_length < 1 or not 0.0 <= noise_density < 1.0 or mean_noise_span_length <= 0:
        raise ValueError("need inputs_length >= 1, 0 <= noise_density < 1, mean length > 0")

    def lengths(tokens_length: int) -> tuple[int, int]:
        num_noise = round(tokens_length * noise_density)
        num_spans = round(num_noise / mean_noise_span_length)
        return (
            tokens_length - num_noise + num_spans * extra_tokens_per_span_inputs + 1,
            num_noise + num_spans * extra_tokens_per_span_targets + 1,
        )

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    inputs_fit, targets_length = lengths(tokens_length)
    # T5's tweak: at density 0.5 make targets no longer than inputs, a likely round number.
    if noise_density == 0.5 and targets_length > inputs_fit:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def _span_counts(length: int, cfg: SpanConfig) -> tuple[int, int]:
    """Return (noise tokens, noise spans) of a row of `length`, as T5 clips them (length >= 2)."""
    # float64 Python rounding, as in random_spans_helper, so that the lengths it promises hold.
    num_noise = min(max(round(length * cfg.noise_density), 1), length - 1)
    num_spans = max(1, round(num_noise / cfg.mean_noise_span_length))
    if num_spans > length - num_noise:
        raise ValueError(f"{num_spans} noise spans need as many non-noise tokens; length {length}")
    return num_noise, num_spans


def _segment_lengths(keys: U64Array, items: int, segments: int, stream: int) -> IntArray:
    """Return (N, segments) random positive lengths summing to `items` (uniform compositions).

    As T5's `_random_segmentation`: a segment starts at a uniformly random subset of
    `segments - 1` of the `items - 1` gaps between items.
    """
    n = keys.shape[0]
    if segments == 1:
        return np.full((n, 1), items, dtype=np.int64)
    prio = _priorities(keys, items - 1, stream)  # (N, items - 1)
    cuts, _ = _first_by_priority(prio, np.full(n, segments - 1, dtype=np.int64))
    gaps = np.sort(cuts, axis=1) + 1  # (N, S - 1) ascending per row
    ends = np.full((n, 1), items, dtype=np.int64)
    return np.diff(np.concatenate([np.zeros_like(ends), gaps, ends], axis=1), axis=1)


def noise_span_mask(length: int, keys: npt.ArrayLike, cfg: SpanConfig) -> BoolArray:
    """Return (N, length) T5 noise masks: alternating non-noise and noise spans.

    Every row has round(length * density) noise tokens (clipped to [1, length - 1]) in
    max(1, round(noise / mean)) spans and starts with a non-noise span; only where the span
    boundaries fall is random. Density 0 gives no noise at all.
    """
    k = _check_keys(keys)
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if cfg.noise_density == 0.0:
        return np.zeros((k.shape[0], length), dtype=bool)
    padded = max(length, 2)  # T5 lengthens a 1-token row to avoid degenerate counts
    num_noise, num_spans = _span_counts(padded, cfg)
    noise = _segment_lengths(k, num_noise, num_spans, _STREAM_NOISE_CUTS)  # (N, S)
    keep = _segment_lengths(k, padded - num_noise, num_spans, _STREAM_NONNOISE_CUTS)  # (N, S)
    spans = np.stack([keep, noise], axis=2).reshape(k.shape[0], 2 * num_spans)  # (N, 2S)
    flips = np.zeros((k.shape[0], padded), dtype=np.int8)  # 1 where a span starts
    np.put_along_axis(flips, np.cumsum(spans, axis=1)[:, :-1], 1, axis=1)
    return np.bitwise_xor.accumulate(flips, axis=1)[:, :length].astype(bool)


def _rows(tokens: npt.ArrayLike, noise: npt.ArrayLike) -> tuple[IntArray, BoolArray, bool]:
    """Return tokens and mask as (N, L) plus whether the input was one 1-D row."""
    t, m = np.asarray(tokens), np.asarray(noise, dtype=bool)
    if t.shape != m.shape or t.ndim not in (1, 2):
        raise ValueError(f"tokens {t.shape} and noise {m.shape} must be the same (L,) or (N, L)")
    return (t[None], m[None], True) if t.ndim == 1 else (t, m, False)


def _compact(tokens: IntArray, keep: BoolArray, squeeze: bool) -> IntArray:
    """Drop the positions where `keep` is False; every row must keep the same number."""
    counts = keep.sum(axis=1)  # (N,)
    if counts.size and (counts != counts[0]).any():
        raise ValueError("rows keep different numbers of tokens; give them equal span counts")
    out = tokens[keep].reshape(tokens.shape[0], int(counts[0]) if counts.size else 0)
    return out[0] if squeeze else out


def _follows_noise(m: BoolArray) -> BoolArray:
    """Return (N, L) True where the previous token is noise."""
    prev = np.zeros_like(m)
    prev[:, 1:] = m[:, :-1]
    return prev


def noise_token_to_sentinel(
    tokens: npt.ArrayLike, noise: npt.ArrayLike, vocab_size: int
) -> IntArray:
    """Replace every noise token by the sentinel `vocab_size - 1`."""
    t, m, squeeze = _rows(tokens, noise)
    out = np.where(m, np.asarray(vocab_size - 1, dtype=t.dtype), t)
    return out[0] if squeeze else out


def noise_span_to_sentinel(
    tokens: npt.ArrayLike, noise: npt.ArrayLike, vocab_size: int
) -> IntArray:
    """Replace every noise span by one sentinel `vocab_size - 1`."""
    t, m, squeeze = _rows(tokens, noise)
    out = np.where(m, np.asarray(vocab_size - 1, dtype=t.dtype), t)
    return _compact(out, ~(m & _follows_noise(m)), squeeze)


def nonnoise_span_to_sentinel(
    tokens: npt.ArrayLike, noise: npt.ArrayLike, vocab_size: int
) -> IntArray:
    """Replace every non-noise span by one sentinel `vocab_size - 1`."""
    return noise_span_to_sentinel(tokens, ~np.asarray(noise, dtype=bool), vocab_size)


def noise_span_to_unique_sentinel(
    tokens: npt.ArrayLike, noise: npt.ArrayLike, vocab_size: int
) -> IntArray:
    """Replace the k-th noise span of a row (k = 0, 1, ...) by the sentinel `vocab_size - 1 - k`.

    Sentinels count down because T5's `<extra_id_0>` is the highest id: pass
    `vocab_size = id(<extra_id_0>) + 1`.
    """
    t, m, squeeze = _rows(tokens, noise)
    inner = m & _follows_noise(m)
    first = m & ~inner  # (N, L) the first token of each noise span
    spans_so_far = np.cumsum(first, axis=1, dtype=np.int32)  # (N, L) int32: the fast cumsum
    if spans_so_far.size and int(spans_so_far[:, -1].max()) > vocab_size:
        raise ValueError(f"more noise spans than sentinel ids below {vocab_size}")
    sentinels = (np.int64(vocab_size) - spans_so_far).astype(t.dtype)  # vocab_size - 1 at span 0
    return _compact(np.where(first, sentinels, t), ~inner, squeeze)


def nonnoise_span_to_unique_sentinel(
    tokens: npt.ArrayLike, noise: npt.ArrayLike, vocab_size: int
) -> IntArray:
    """Replace the k-th non-noise span of a row by the sentinel `vocab_size - 1 - k`."""
    return noise_span_to_unique_sentinel(tokens, ~np.asarray(noise, dtype=bool), vocab_size)


def drop_noise_tokens(tokens: npt.ArrayLike, noise: npt.ArrayLike) -> IntArray:
    """Keep only the non-noise tokens."""
    t, m, squeeze = _rows(tokens, noise)
    return _compact(t, ~m, squeeze)


def drop_nonnoise_tokens(tokens: npt.ArrayLike, noise: npt.ArrayLike) -> IntArray:
    """Keep only the noise tokens."""
    t, m, squeeze = _rows(tokens, noise)
    return _compact(t, m, squeeze)


def span_corrupt(
    tokens: npt.ArrayLike, keys: npt.ArrayLike, cfg: SpanConfig, sentinel_top: int, eos_id: int
) -> tuple[IntArray, IntArray, BoolArray]:
    """Apply T5's span corruption to (N, raw_length) tokens.

    Inputs are the row with each noise span replaced by a unique sentinel, plus EOS; targets
    are the row with each non-noise span replaced by a unique sentinel, plus EOS, so each
    sentinel in the targets precedes the noise it stands for in the inputs. With
    `raw_length = random_spans_helper(I, ...)[0]` the inputs are exactly I long.

    Args:
        tokens: (N, raw_length) token ids, free of sentinel ids.
        keys: (N,) uint64 keys from `sample_keys`.
        cfg: Noise density and mean span length.
        sentinel_top: The id of the first sentinel (T5's `<extra_id_0>`); later spans count
            down from it.
        eos_id: The id appended to inputs and targets.

    Returns:
        inputs (N, I), targets (N, T) and the noise mask (N, raw_length).
    """
    t = np.asarray(tokens)
    if t.ndim != 2:
        raise ValueError(f"tokens must be (N, raw_length), got {t.shape}")
    k = _check_keys(keys, t.shape[0])
    if t.shape[0] == 0:  # an empty batch still gets the widths that every row has
        row = np.zeros((1, t.shape[1]), dtype=t.dtype)
        one = span_corrupt(row, np.zeros(1, dtype=np.uint64), cfg, sentinel_top, eos_id)
        return one[0][:0], one[1][:0], one[2][:0]
    noise = noise_span_mask(t.shape[1], k, cfg)  # (N, raw)
    eos = np.full((t.shape[0], 1), eos_id, dtype=t.dtype)
    inputs = noise_span_to_unique_sentinel(t, noise, sentinel_top + 1)  # (N, I - 1)
    targets = nonnoise_span_to_unique_sentinel(t, noise, sentinel_top + 1)  # (N, T - 1)
    return np.concatenate([inputs, eos], axis=1), np.concatenate([targets, eos], axis=1), noise


# ---- BART denoising: sentence permutation and text infilling ---------------------------------


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
    k = _check_keys(keys)
    need = np.asarray(budget, dtype=np.int64).reshape(-1)
    if need.shape != k.shape or (need.size and int(need.min()) < 0):
        raise ValueError(f"budget must be (N,) non-negative for {k.shape[0]} keys")
    cdf = _poisson_cdf(lam)
    width = math.ceil(1.25 * int(need.max(initial=0)) / lam) + 8
    while True:  # a rare unlucky row doubles the width; earlier columns never change
        draws = np.searchsorted(cdf, counter_uniform(k, width, _STREAM_DN_LENGTHS), side="right")
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
    k = _check_keys(keys, n)
    col = np.arange(width)[None, :]  # (1, L)
    inside = (col >= 1) & (col < lens[:, None] - 1)  # (N, L) between <s> and </s>
    first = inside & (starts | (col == 1))
    sentence = np.maximum(np.cumsum(first, axis=1, dtype=np.int32) - 1, 0)  # (N, L)
    count = first.sum(axis=1).astype(np.int64)  # (N,)
    chosen = counter_uniform(k, 1, _STREAM_DN_PERMUTE_ROW)[:, 0] < cfg.permute_sentences
    prio = _priorities(k, width, _STREAM_DN_SENTENCES, col < count[:, None])
    order, valid = _first_by_priority(prio, np.where(chosen, count, 0))  # (N, K) new order
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
    u = counter_uniform(keys, 1, _STREAM_DN_BUDGET)[:, 0]  # (N,)
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
    k = _check_keys(keys, n)
    content = lens - 2  # (N,) tokens between <s> and </s>
    budget, spans, count = _span_layout(k, content, width - 2, cfg)
    # A row is a sequence of items: its kept tokens, in order, and its spans. A random order
    # of all the items places the spans (items < count) uniformly among the kept tokens.
    items = content - budget + count  # (N,) <= width - 2 unless replace_length=0
    # At least `width` columns, whatever the batch: a row's order then depends on its key only.
    cols = np.arange(max(width, int(items.max(initial=0))))[None, :]
    prio = _priorities(k, cols.shape[1], _STREAM_DN_LAYOUT, cols < items[:, None])
    order, real = _first_by_priority(prio, items)  # (N, T) item ids in row order
    is_span = real & (order < count[:, None])
    span_len = np.take_along_axis(spans, np.where(is_span, order, 0), axis=1)  # (N, T)
    consumed = np.where(is_span, span_len, real)  # (N, T) input tokens per item
    written = {
        1: real.astype(np.int64),
        0: np.where(is_span, span_len == 0, real),
        -1: np.where(is_span, np.maximum(span_len, 1), real),
    }[cfg.replace_length].astype(np.int64)  # (N, T) output tokens per item
    src = 1 + np.cumsum(consumed, axis=1) - consumed  # (N, T) first input position
    out_len = written.sum(axis=1) + 2  # (N,)
    out = np.full_like(ids, pad_id)
    out[:, :1] = ids[:, :1]
    out[np.arange(n), out_len - 1] = ids[np.arange(n), lens - 1]
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
    pick = _to_unit(_bits_at(keys[rows], _STREAM_DN_RANDOM, cols)) < ratio
    r_rows, r_cols = rows[pick], cols[pick]
    if r_rows.size:
        pool = np.asarray(random_ids).reshape(-1)
        if pool.size == 0:
            raise ValueError("random_ids is empty but random_ratio > 0")
        draw = _bits_at(keys[r_rows], _STREAM_DN_TOKEN, r_cols) % np.uint64(pool.size)
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
