"""The counter-based random numbers every objective draws from, and the array types they share.

A sample's key hashes (run seed, epoch, global sample index), and every random number hashes
(key, stream, position), so a sample gets the same mask in any batch, worker or process and no
generator state travels. Each decision (positions, 80/10/10 with its replacement token, word
order, span layout) reads its own stream, so changing one never shifts another; the streams are
numbered here, in one place, so that no two decisions share one. Nothing here reads files, the
clock or the environment.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

U64Array = npt.NDArray[np.uint64]
U32Array = npt.NDArray[np.uint32]
IntArray = npt.NDArray[np.integer]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]

_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's odd increment, 2^64 / golden ratio
_SALT_SEED, _SALT_EPOCH, _SALT_INDEX, _SALT_STREAM = (
    0x243F6A8885A308D3,  # digits of pi: arbitrary, fixed, distinct salts
    0x13198A2E03707344,
    0xA4093822299F31D0,
    0x082EFA98EC4E6C89,
)
_NO_PRIORITY = np.uint64(np.iinfo(np.uint64).max)  # sorts after every real priority
# The streams: one per decision, never reused (a changed number changes every sample's draw).
STREAM_MLM_POSITIONS, STREAM_MLM_ACTION, STREAM_MLM_WORDS = 1, 2, 4  # 3: retired
STREAM_NOISE_CUTS, STREAM_NONNOISE_CUTS = 5, 6
STREAM_MLM_COUNT = 7
STREAM_DN_BUDGET, STREAM_DN_LENGTHS, STREAM_DN_LAYOUT = 8, 9, 10
STREAM_DN_RANDOM, STREAM_DN_TOKEN = 11, 12
STREAM_DN_PERMUTE_ROW, STREAM_DN_SENTENCES = 13, 14


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


def check_keys(keys: npt.ArrayLike, rows: int | None = None) -> U64Array:
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


def row_bases(keys: U64Array, stream: int) -> U64Array:
    """Return the uint64 that seeds the (key, stream) sequence, per key."""
    return _mix64(keys ^ _stream_salt(stream))


def bits_at(keys: U64Array, stream: int, cols: npt.NDArray[np.integer]) -> U64Array:
    """Return the random uint64 at (key, stream, col) for broadcast `keys` and `cols`.

    The (key, stream) pair seeds a splitmix64 sequence and `col` indexes into it, so any
    single value can be computed without the ones before it.
    """
    return bits_from_bases(row_bases(keys, stream), cols)


def bits_from_bases(bases: U64Array, cols: npt.NDArray[np.integer]) -> U64Array:
    """Return `bits_at` given the keys' `row_bases` (mixed once per row, then gathered)."""
    return _mix64(bases + (cols.astype(np.uint64) + np.uint64(1)) * np.uint64(_GAMMA))


def counter_bits(keys: npt.ArrayLike, width: int, stream: int) -> U64Array:
    """Return (N, width) random uint64; [i, j] depends only on (keys[i], stream, j)."""
    k = check_keys(keys)
    return bits_at(k[:, None], stream, np.arange(width)[None, :])  # (N, width)


def to_unit(bits: U64Array) -> FloatArray:
    """Map uint64 to float64 in [0, 1) with the top 53 bits (every value exact)."""
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def counter_uniform(keys: npt.ArrayLike, width: int, stream: int) -> FloatArray:
    """Return (N, width) float64 uniforms in [0, 1); [i, j] depends only on (keys[i], stream, j).

    Args:
        keys: (N,) uint64 keys from `sample_keys`.
        width: Values per row.
        stream: The purpose of the draw; different streams give independent values.
    """
    return to_unit(counter_bits(keys, width, stream))


def priorities(
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


def first_by_priority(
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


def hash32(bases: U64Array, cols: npt.NDArray[np.integer]) -> U32Array:
    """Return the random uint32 at (row, col) for broadcast `row_bases` and `cols`.

    A cheaper stream than `bits_at` for the per-position priorities of `mask_tokens`:
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
