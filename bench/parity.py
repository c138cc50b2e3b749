"""Output parity checks of the CPU benchmarks: the compared arms must produce the same output.

The benchmark phases run in separate processes, so each arm saves what it produced (untimed)
and the orchestrator compares: `tokenizer_encode.py` the ids of every encode arm,
`examples_throughput.py` the causal blocks of lmpipe and `group_texts`, and the masking
invariants of `mask_tokens` and `DataCollatorForLanguageModeling`. A failed check raises
`ParityError`, and the scripts exit non-zero.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

IGNORE_INDEX = -100


class ParityError(SystemExit):
    """Two arms of a comparison did not produce the same output; the benchmark is void."""


def save_ids(path: Path, flat: npt.ArrayLike, lengths: npt.ArrayLike) -> None:
    """Save one arm's ids: the flat ids and the number of ids of each segment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, flat=np.asarray(flat, np.int64), lengths=np.asarray(lengths, np.int64))


def differing_segments(reference: Path, other: Path) -> dict[str, int]:
    """Count the segments whose ids differ between two `save_ids` files (0: same ids)."""
    ref, oth = np.load(reference), np.load(other)
    ref_len, oth_len = ref["lengths"], oth["lengths"]
    if len(ref_len) != len(oth_len):
        return {"segments": len(ref_len), "differing": len(ref_len), "tokens": -1}
    ref_flat, oth_flat = ref["flat"], oth["flat"]
    same_len = ref_len == oth_len
    differing = int((~same_len).sum())
    if same_len.all() and np.array_equal(ref_flat, oth_flat):
        return {"segments": len(ref_len), "differing": 0, "tokens": len(ref_flat)}
    ref_at = np.concatenate([[0], np.cumsum(ref_len)])
    oth_at = np.concatenate([[0], np.cumsum(oth_len)])
    for k in np.flatnonzero(same_len):  # only reached when something differs
        a = ref_flat[ref_at[k] : ref_at[k + 1]]
        if not np.array_equal(a, oth_flat[oth_at[k] : oth_at[k + 1]]):
            differing += 1
    return {"segments": len(ref_len), "differing": differing, "tokens": len(ref_flat)}


def expected_blocks(
    doc_lengths: npt.NDArray[np.int64],
    stream: npt.NDArray[Any],
    restarts: npt.NDArray[np.int64],
    block: int,
) -> npt.NDArray[Any]:
    """The blocks of `stream` cut afresh at each restart document, each run's tail dropped.

    `doc_lengths` counts each document's tokens with its end-of-text; `stream` is every
    document followed by its end-of-text; `restarts` are the document indices where an arm
    starts a new concatenation (a shard for lmpipe, a batch for `group_texts`).
    """
    at = np.concatenate([[0], np.cumsum(doc_lengths)])
    bounds = np.unique(np.concatenate([restarts, [len(doc_lengths)]]))
    parts = []
    for a, b in itertools.pairwise(bounds):
        run = stream[at[a] : at[b]]
        parts.append(run[: len(run) // block * block].reshape(-1, block))
    return np.concatenate(parts) if parts else np.empty((0, block), stream.dtype)


def require_equal_blocks(name: str, got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    """Raise `ParityError` unless `got` has exactly the blocks of `want`, in order."""
    if got.shape != want.shape or not np.array_equal(got, want):
        raise ParityError(f"{name}: {got.shape} blocks differ from the expected {want.shape}")


def same_rows(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    """Whether `a` and `b` hold the same rows in any order (a multiset of rows)."""
    if a.shape != b.shape:
        return False
    key = [f"f{i}" for i in range(a.shape[1])]
    view = np.dtype([(k, a.dtype) for k in key])
    sa = np.sort(np.ascontiguousarray(a).view(view).ravel(), order=key)
    sb = np.sort(np.ascontiguousarray(b.astype(a.dtype)).view(view).ravel(), order=key)
    return bool(np.array_equal(sa, sb))


def masking_counts(
    original: npt.NDArray[np.int64],
    special: npt.NDArray[np.bool_],
    new_ids: npt.NDArray[np.int64],
    labels: npt.NDArray[np.int64],
    mask_id: int,
) -> dict[str, int]:
    """Check one masked batch's invariants and count its 80/10/10 outcome.

    Raises:
        ParityError: a label sits on a special token or does not hold the original id, or an
            unchosen position changed.
    """
    chosen = labels != IGNORE_INDEX
    if (chosen & special).any():
        raise ParityError("a special token was chosen for prediction")
    if not np.array_equal(labels[chosen], original[chosen]):
        raise ParityError("a label is not the original id")
    if not np.array_equal(new_ids[~chosen], original[~chosen]):
        raise ParityError("an unchosen position changed")
    masked = chosen & (new_ids == mask_id)
    randomized = chosen & ~masked & (new_ids != original)
    return {
        "chosen": int(chosen.sum()),
        "masked": int(masked.sum()),
        "randomized": int(randomized.sum()),
        "maskable": int((~special).sum()),
    }


def masking_summary(counts: list[dict[str, int]]) -> dict[str, Any]:
    """The realised mask rate and the masked / randomized / kept shares over all batches."""
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    chosen = total["chosen"]
    return {
        "mask_rate": chosen / total["maskable"],
        "shares": {
            "masked": total["masked"] / chosen,
            "randomized": total["randomized"] / chosen,
            "kept": 1 - (total["masked"] + total["randomized"]) / chosen,
        },
        "counts": total,
    }


def require_same_masking(arms: dict[str, dict[str, Any]], tolerance: float = 0.01) -> None:
    """Raise `ParityError` unless every arm masks 15% of maskable tokens, 80/10/10, ±tolerance.

    The arms draw different random numbers, so their outputs agree in distribution only: the
    per-batch invariants are checked exactly in `masking_counts`, the rates here.
    """
    for name, arm in arms.items():
        want = {"masked": 0.8, "randomized": 0.1, "kept": 0.1}
        off = {k: abs(arm["shares"][k] - v) for k, v in want.items()}
        off["rate"] = abs(arm["mask_rate"] - 0.15)
        if max(off.values()) > tolerance:
            raise ParityError(f"masking arm {name} is off the 15% / 80-10-10 recipe: {off}")
