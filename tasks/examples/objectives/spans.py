"""T5's span corruption: noise masks of alternating spans, sentinels, and the length arithmetic.

Vectorised over a batch of rows, with the counter-based random numbers of `rng`; the helpers that
turn a noise mask into inputs and targets follow T5's `preprocessors.py` names.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from tasks.examples.objectives.rng import (
    STREAM_NOISE_CUTS,
    STREAM_NONNOISE_CUTS,
    BoolArray,
    IntArray,
    U64Array,
    check_keys,
    first_by_priority,
    priorities,
)


class SpanConfig(BaseModel):
    """T5 span corruption: how much of a row is noise and how long its spans are on average."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    noise_density: float = Field(
        0.15, ge=0.0, lt=1.0, description="Share of the raw tokens that are noise."
    )
    mean_noise_span_length: float = Field(
        3.0, ge=1.0, description="Mean length in tokens of a noise span."
    )


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
    prio = priorities(keys, items - 1, stream)  # (N, items - 1)
    cuts, _ = first_by_priority(prio, np.full(n, segments - 1, dtype=np.int64))
    gaps = np.sort(cuts, axis=1) + 1  # (N, S - 1) ascending per row
    ends = np.full((n, 1), items, dtype=np.int64)
    return np.diff(np.concatenate([np.zeros_like(ends), gaps, ends], axis=1), axis=1)


def noise_span_mask(length: int, keys: npt.ArrayLike, cfg: SpanConfig) -> BoolArray:
    """Return (N, length) T5 noise masks: alternating non-noise and noise spans.

    Every row has round(length * density) noise tokens (clipped to [1, length - 1]) in
    max(1, round(noise / mean)) spans and starts with a non-noise span; only where the span
    boundaries fall is random. Density 0 gives no noise at all.
    """
    k = check_keys(keys)
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if cfg.noise_density == 0.0:
        return np.zeros((k.shape[0], length), dtype=bool)
    padded = max(length, 2)  # T5 lengthens a 1-token row to avoid degenerate counts
    num_noise, num_spans = _span_counts(padded, cfg)
    noise = _segment_lengths(k, num_noise, num_spans, STREAM_NOISE_CUTS)  # (N, S)
    keep = _segment_lengths(k, padded - num_noise, num_spans, STREAM_NONNOISE_CUTS)  # (N, S)
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
    k = check_keys(keys, t.shape[0])
    if t.shape[0] == 0:  # an empty batch still gets the widths that every row has
        row = np.zeros((1, t.shape[1]), dtype=t.dtype)
        one = span_corrupt(row, np.zeros(1, dtype=np.uint64), cfg, sentinel_top, eos_id)
        return one[0][:0], one[1][:0], one[2][:0]
    noise = noise_span_mask(t.shape[1], k, cfg)  # (N, raw)
    eos = np.full((t.shape[0], 1), eos_id, dtype=t.dtype)
    inputs = noise_span_to_unique_sentinel(t, noise, sentinel_top + 1)  # (N, I - 1)
    targets = nonnoise_span_to_unique_sentinel(t, noise, sentinel_top + 1)  # (N, T - 1)
    return np.concatenate([inputs, eos], axis=1), np.concatenate([targets, eos], axis=1), noise
