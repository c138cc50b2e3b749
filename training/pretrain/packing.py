"""Document-boundary attention for packed causal blocks: position resets, block-diagonal masks.

A causal block (`examples.objective=causal`) holds several documents; its `doc_starts` column
lists where each one starts. With these, a document attends only to itself and its positions
start again at 0, exactly as if it had been run alone. The mask is passed to the model as a
4-D additive mask (`causal_document_mask`, `train.attention` dense), or as a FlexAttention
block mask (`document_block_mask`, flex): a 2-D padding mask would silently fall back to plain
causal attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import numpy as np
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def document_ids(doc_starts: Sequence[Sequence[int]], block_size: int) -> np.ndarray:
    """(B, L) int64: the number of the document each position belongs to, within its block."""
    marks = np.zeros((len(doc_starts), block_size), dtype=np.int64)  # (B, L)
    for row, starts in enumerate(doc_starts):
        marks[row, np.asarray(starts, dtype=np.int64)] = 1
    return np.cumsum(marks, axis=1)


def document_positions(doc_starts: Sequence[Sequence[int]], block_size: int) -> np.ndarray:
    """(B, L) int64 position ids that restart at 0 where each document starts."""
    docs = document_ids(doc_starts, block_size)  # (B, L)
    index = np.broadcast_to(np.arange(block_size), docs.shape)  # (B, L)
    first = np.zeros_like(docs)
    changed = np.ones_like(docs, dtype=bool)
    changed[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first[changed] = index[changed]
    return index - np.maximum.accumulate(first, axis=1)  # (B, L)


def causal_document_mask(documents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, L, L) additive mask: 0 where query i may see key j (j ≤ i, same document).

    Built where `documents` (B, L) lies: on the GPU from the batch's small document ids, rather
    than on the host and copied (a (B, L, L) mask is 64 MiB per GPT-2 batch of 32 x 1,024).

    Blocked entries hold the dtype's most negative value, as `transformers` masks do, so their
    softmax weight is exactly 0 and other documents cannot change a document's outputs.
    """
    length, device = documents.shape[1], documents.device
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # (L, L)
    same = documents[:, :, None] == documents[:, None, :]  # (B, L, L)
    allowed = (same & causal)[:, None]  # (B, 1, L, L)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


@cache
def _compiled_create_block_mask() -> Callable[..., BlockMask]:
    # Compiled, it evaluates the mask tile by tile; eager, it first builds the (B, L, L) mask.
    return torch.compile(create_block_mask)


def document_block_mask(documents: torch.Tensor, window: int | None = None) -> BlockMask:
    """FlexAttention's block mask of `causal_document_mask`, with a sliding `window` if given.

    Query i may see key j where j <= i, both lie in the same document of `documents` (B, L)
    and, with a window, i - j < window (a sliding-window model's own rule: Mistral). Built on
    the device of `documents`, with no host read; tiles no query may see are skipped by the
    kernel, not computed and masked.
    """
    batch, length = documents.shape

    def allowed(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:  # index tensors
        keep = (kv <= q) & (documents[b, q] == documents[b, kv])
        return keep & (q - kv < window) if window else keep

    eager = documents.device.type == "cpu" or torch.compiler.is_compiling()
    build = create_block_mask if eager else _compiled_create_block_mask()
    mask: BlockMask = build(allowed, batch, None, length, length, device=documents.device)
    # GPT-2's forward reads `attention_mask.ndim` (a tensor's) before transformers' mask code,
    # which takes any 4-D `BlockMask` as given; a block mask has `shape` but no `ndim`.
    mask.ndim = len(mask.shape)  # type: ignore[attr-defined]
    return mask
