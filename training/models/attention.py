"""FlexAttention for document-masked causal blocks, SDPA for everything else.

transformers 5 runs a layer's attention through the function registered under the model's
`config._attn_implementation`. `DOCUMENT_FLEX` names ours (`train.attention` flex): a layer given
a FlexAttention `BlockMask` (a packed block's documents, built from its document ids by
`training.pretrain.packing.document_block_mask`) runs the FlexAttention kernel, which computes
only the tiles some query may see, with no (B, 1, L, L) mask in memory. Any other call is
transformers' own SDPA with its own masks: no mask (SDPA's causal flash kernel), a padding mask,
a dense 4-D mask, generation with a KV cache. transformers' `flex_attention` implementation is
not used: it refuses GPT-2, and it would run every batch through FlexAttention.

The name lives only in the training model's config: config.json never records it, and every
export is built with SDPA (`training.models.models.build_model`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The attention implementation of `train.attention` flex; no transformers name contains it.
DOCUMENT_FLEX = "lmpipe_document_flex"


@cache
def _compiled_flex() -> Callable[..., Tensor]:
    """FlexAttention compiled once per process: uncompiled, it materialises every score."""
    return torch.compile(flex_attention)


def flex_kernel(device: torch.device) -> Callable[..., Tensor]:
    """`flex_attention` as it should run on `device`: compiled on a GPU.

    Inside a graph being compiled (`train.compile`) the plain function is traced into it. On a
    CPU, which has no FlexAttention backward, it runs eagerly: that serves checks of the
    forward pass.
    """
    if device.type == "cpu" or torch.compiler.is_compiling():
        return flex_attention
    return _compiled_flex()


def document_flex_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | BlockMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """One layer's attention: FlexAttention under a `BlockMask`, else transformers' SDPA.

    `query` (B, H, L, D), `key` and `value` (B, H_kv, L, D); returns (B, L, H, D) and no
    weights, as every transformers attention function does.

    Raises:
        ValueError: a `BlockMask` with attention dropout, which FlexAttention cannot apply
            (`train.attention` flex is refused at config load for such a model).
    """
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout > 0:
        raise ValueError(
            f"FlexAttention has no attention dropout (the layer asks for {dropout}): set "
            "train.model.dropout=0, or train.attention to dense"
        )
    # The sliding window, if any, is part of the block mask (`document_block_mask`).
    out = flex_kernel(query.device)(
        query,
        key,
        value,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],  # grouped-query heads: Mistral, Mixtral
    )  # (B, H, L, D)
    return out.transpose(1, 2).contiguous(), None


def register_document_flex() -> None:
    """Register `DOCUMENT_FLEX` with transformers' attention and mask interfaces (idempotent).

    Its masks are SDPA's: with no `BlockMask` given, a layer sees exactly what SDPA would.
    """
    AttentionInterface.register(DOCUMENT_FLEX, document_flex_attention)
    AttentionMaskInterface.register(DOCUMENT_FLEX, sdpa_mask)


def uses_document_flex(config: Any) -> bool:
    """Whether a model built with `config` attends through `DOCUMENT_FLEX`."""
    return bool(getattr(config, "_attn_implementation", None) == DOCUMENT_FLEX)
