"""Exact and near-duplicate removal that keeps the copy with the smallest (file, offset).

Exact dedup works on 128-bit content hashes with NumPy: the driver holds 16 bytes of hash plus
8 bytes of (unit, row) key per document, nothing else, and sorts once. Near dedup (MinHash + LSH,
datasketch) walks the surviving documents in key order, so its result does not depend on which
worker finished first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import xxhash
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from datasketch import LeanMinHash

HASH_HI = "hash_hi"
HASH_LO = "hash_lo"
MINHASH = "minhash"
# datasketch 2's bijective 32-bit permutation scheme: 4 bytes per permutation per document.
_SCHEME = "affine32"


class NearDedupConfig(BaseModel):
    """MinHash/LSH near-duplicate removal over word shingles."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    enabled: bool = Field(False, description="Remove near-duplicates (estimated Jaccard).")
    threshold: float = Field(0.8, gt=0, lt=1, description="Jaccard similarity that counts.")
    num_perm: int = Field(128, ge=16, le=1024, description="MinHash permutations.")
    shingle_words: int = Field(5, ge=1, le=32, description="Words per shingle.")
    seed: int = Field(1, description="MinHash seed.")


class DedupConfig(BaseModel):
    """Which duplicates ingestion removes."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    exact: bool = Field(True, description="Remove exact duplicates (after clean-up), corpus-wide.")
    near: NearDedupConfig = Field(default_factory=NearDedupConfig)


def content_hashes(texts: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Return the (high, low) 64-bit halves of each text's xxh3-128 hash (of its UTF-8 bytes).

    The hash reads each value's bytes straight from the Arrow data buffer: no Python string is
    made (decoding and re-encoding every text cost twice as much).
    """
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        raise TypeError(f"content_hashes takes a string column, not {texts.type}")
    if texts.null_count:
        raise ValueError(f"content_hashes: the column holds {texts.null_count} nulls")
    chunks = texts.chunks if isinstance(texts, pa.ChunkedArray) else [texts]
    digest = xxhash.xxh3_128_digest
    parts: list[bytes] = []
    for chunk in chunks:
        if not len(chunk):
            continue
        width = np.dtype(np.int64 if pa.types.is_large_string(chunk.type) else np.int32)
        skip = chunk.offset * width.itemsize
        bounds = np.frombuffer(chunk.buffers()[1], width, len(chunk) + 1, skip)
        data = memoryview(chunk.buffers()[2] or b"")
        starts, ends = bounds[:-1].tolist(), bounds[1:].tolist()
        parts.append(b"".join([digest(data[a:b]) for a, b in zip(starts, ends, strict=True)]))
    # The digest is the 128-bit value big-endian: the high half first.
    halves = np.frombuffer(b"".join(parts), ">u8").reshape(-1, 2)
    return halves[:, 0].astype(np.uint64), halves[:, 1].astype(np.uint64)


_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def hex_ids(hi: np.ndarray, lo: np.ndarray) -> pa.Array:
    """Each 128-bit (hi, lo) pair as 32 lowercase hex digits, high half first (a string array).

    The same text as `f"{(hi << 64) | lo:032x}"`, built with NumPy instead of a Python loop.
    """
    if hi.shape != lo.shape or hi.ndim != 1:
        raise ValueError(f"hex_ids takes two 1-D arrays of one length: {hi.shape}, {lo.shape}")
    n = len(hi)
    pairs = np.empty((n, 2), ">u8")
    pairs[:, 0], pairs[:, 1] = hi, lo
    nibbles = pairs.view(np.uint8).reshape(n, 16)
    digits = np.empty((n, 32), np.uint8)
    digits[:, 0::2] = _HEX[nibbles >> 4]
    digits[:, 1::2] = _HEX[nibbles & 15]
    offsets = np.arange(0, 32 * (n + 1), 32, dtype=np.int32)
    return pa.Array.from_buffers(
        pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(digits)]
    )


def exact_keep_mask(
    hi: np.ndarray,
    lo: np.ndarray,
    prior_hi: np.ndarray | None = None,
    prior_lo: np.ndarray | None = None,
) -> np.ndarray:
    """Return a bool mask over documents given in key order: True for the first of each hash.

    Documents must be passed in (file, offset) order; a stable sort then keeps the smallest key.
    A document whose hash is in `prior_*` (an earlier ingest) is always a duplicate.
    """
    n_prior = 0 if prior_hi is None else len(prior_hi)
    all_hi = hi if prior_hi is None else np.concatenate([prior_hi, hi])
    all_lo = lo if prior_lo is None else np.concatenate([prior_lo, lo])
    order = np.lexsort((all_lo, all_hi))  # lexsort is stable: ties keep key order
    s_hi, s_lo = all_hi[order], all_lo[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (s_hi[1:] != s_hi[:-1]) | (s_lo[1:] != s_lo[:-1])
    keep = np.empty(len(order), dtype=bool)
    keep[order] = first
    return keep[n_prior:]


def minhash_signatures(texts: pa.Array, cfg: NearDedupConfig) -> pa.Array:
    """Return a fixed-size list<uint32> MinHash signature per text over word shingles."""
    shingle_sets = []
    for text in texts.to_pylist():
        words = text.lower().split()
        k = min(cfg.shingle_words, max(len(words), 1))
        shingles = {" ".join(words[i : i + k]).encode() for i in range(max(len(words) - k + 1, 1))}
        shingle_sets.append(list(shingles))
    # Imported here: datasketch pulls in scipy (~1 s), which only near dedup needs.
    from datasketch import MinHash

    hashes = MinHash.bulk(
        shingle_sets,
        num_perm=cfg.num_perm,
        seed=cfg.seed,
        hashfunc=xxhash.xxh32_intdigest,
        scheme=_SCHEME,
    )
    flat = (
        np.concatenate([m.hashvalues.astype(np.uint32) for m in hashes])
        if hashes
        else np.empty(0, np.uint32)
    )
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.uint32()), cfg.num_perm)


def near_keep_mask(
    signatures: Iterable[np.ndarray],
    cfg: NearDedupConfig,
    prior: Iterable[np.ndarray] = (),
) -> list[bool]:
    """Walk signatures in key order; drop each whose estimated Jaccard to a kept one is high.

    `prior` holds signatures of documents kept by an earlier ingest; they are never dropped.
    """
    from datasketch import LeanMinHash, MinHashLSH  # see minhash_signatures

    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
    kept: dict[int, LeanMinHash] = {}

    def lean(values: np.ndarray) -> LeanMinHash:
        return LeanMinHash(seed=cfg.seed, hashvalues=values, scheme=_SCHEME)

    for key, values in enumerate(prior):
        kept[-key - 1] = lean(values)
        lsh.insert(-key - 1, kept[-key - 1])
    mask = []
    for key, values in enumerate(signatures):
        sig = lean(values)
        near = any(kept[other].jaccard(sig) >= cfg.threshold for other in lsh.query(sig))
        mask.append(not near)
        if not near:
            kept[key] = sig
            lsh.insert(key, sig)
    return mask
