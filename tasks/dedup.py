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


def content_hashes(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Return the (high, low) 64-bit halves of each text's xxh3-128 hash."""
    digests = [xxhash.xxh3_128_intdigest(text.encode()) for text in texts.to_pylist()]
    hi = np.fromiter((d >> 64 for d in digests), dtype=np.uint64, count=len(digests))
    lo = np.fromiter((d & 0xFFFFFFFFFFFFFFFF for d in digests), dtype=np.uint64, count=len(digests))
    return hi, lo


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
