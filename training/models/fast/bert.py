"""BERT's fast path: `BertForPreTraining` whose encoder runs a leaner forward.

`FastBertForPreTraining` is transformers' `BertForPreTraining` with its `bert` built as
`FastBertModel`, a `BertModel` subclass: the same modules, built by the same constructor in the
same order, so the same parameter names, initial values under one seed, and checkpoints. Only
`FastBertModel.forward` changes, on the calls pretraining makes (`pair_loss` calls
`model.base_model` with ids, token types and a padding mask; the full forward calls it too):

- one matmul for query, key and value, over the three weights concatenated in the graph (the
  parameters stay separate and stock-named; their gradients are the slices of the fused one's);
- `scaled_dot_product_attention` called directly with the mask as given, a (B, T) padding mask
  turned into a boolean (B, 1, 1, T) one on the device (transformers' mask builder reads a 2-D
  mask on the host to see whether it can drop it);
- none of the per-layer wrappers (checkpointing layer, attention interface lookup, chunking,
  output capture); embeddings, residual adds and LayerNorms inlined;
- dropout with the config's probabilities, in train mode only, from a uniform draw
  (`_dropout`), with the residual added in place into its fresh product.

The other calls (attention other than SDPA, a decoder or cross-attention, activation
checkpointing, attention or hidden-state outputs, a cache, `inputs_embeds`, a tuple return,
arguments it does not know, FlexAttention's BlockMask, ZeRO-3-partitioned weights) take the
stock forward. What lives elsewhere: the losses (training/pretrain/losses/encoder.py), the
export (training/models/export.py saves the stock class via `training.models.fast.as_stock`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
import transformers as tf
from torch import Tensor
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
from transformers.models.bert.modeling_bert import (
    BertEmbeddings,
    BertLayer,
    BertOutput,
    BertPreTrainingHeads,
    BertSelfOutput,
)

#: Keyword arguments the fast path takes, when they ask for nothing beyond the plain output.
_PLAIN_KWARGS = frozenset({"return_dict", "output_attentions", "output_hidden_states"})


def _plain_output(config: tf.BertConfig, kwargs: dict[str, Any]) -> bool:
    """Whether the call asks for the output dataclass only (no tuple, attentions, states)."""
    if not _PLAIN_KWARGS.issuperset(kwargs):
        return False
    if kwargs.get("return_dict", getattr(config, "return_dict", True)) is False:
        return False
    return not any(
        kwargs.get(name, getattr(config, name, False))
        for name in ("output_attentions", "output_hidden_states")
    )


def _attend_mask(mask: Tensor | None) -> Tensor | None:
    """The mask SDPA takes: None, a 4-D mask as given, or a (B, T) mask as bool (B, 1, 1, T)."""
    if mask is None or mask.dim() == 4:
        return mask
    return mask.bool()[:, None, None, :]  # (B, 1, 1, T), True: attend


def _layer_forward(layer: BertLayer, x: Tensor, mask: Tensor | None) -> Tensor:
    """One post-LN encoder layer on `x` (B, T, D), as `BertLayer` computes it."""
    att = layer.attention.self
    b, t, d = x.shape
    heads, head_dim = att.num_attention_heads, att.attention_head_size
    # Concatenating in the graph keeps the three parameters (and their names) apart; the copy
    # is 3·D² floats a layer, small beside the (B·T, D) x (D, 3D) matmul it saves two launches
    # and two passes over x for (and as many in the backward).
    weight = torch.cat((att.query.weight, att.key.weight, att.value.weight))  # (3D, D)
    bias = torch.cat((att.query.bias, att.key.bias, att.value.bias))  # (3D,)
    qkv = F.linear(x, weight, bias).view(b, t, 3, heads, head_dim)  # (B, T, 3, H, Dh)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, Dh) each
    y = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=att.dropout.p if att.training else 0.0,
        scale=att.scaling,
    )  # (B, H, T, Dh)
    y = y.transpose(1, 2).reshape(b, t, d)  # (B, T, D)
    x = _add_norm(layer.attention.output, y, x)
    return _add_norm(layer.output, layer.intermediate(x), x)


def _dropout(h: Tensor, p: float, training: bool) -> Tensor:
    """Dropout with probability `p` in train mode; `h` itself otherwise.

    A kept unit is scaled by 1 / (1 - p), as `F.dropout` does; the mask is drawn from a
    uniform sample (`rand >= p`), a pass cheaper on a CPU than `F.dropout`'s Bernoulli
    sample, divide and multiply (about 25% at BERT-mini's width, one thread, forward and
    backward).
    """
    if not training or p == 0.0:
        return h
    if p >= 1.0:
        return h * 0.0
    # In `h`'s dtype: a bool mask times a Python float is a float32 tensor, which would turn a
    # bf16 activation into float32.
    keep = (torch.rand_like(h) >= p).to(h.dtype) * (1.0 / (1.0 - p))  # 0 or 1 / (1 - p)
    return h * keep


def _dropout_add(h: Tensor, residual: Tensor, p: float, training: bool) -> Tensor:
    """`dropout(h) + residual`."""
    dropped = _dropout(h, p, training)
    if dropped is h:
        return h + residual
    # A fresh product that no backward reads: the residual can be added in place.
    return dropped.add_(residual)


def _add_norm(block: BertSelfOutput | BertOutput, h: Tensor, residual: Tensor) -> Tensor:
    """`block`'s forward: LayerNorm(dropout(dense(h)) + residual)."""
    dropped = _dropout_add(block.dense(h), residual, block.dropout.p, block.training)
    out: Tensor = block.LayerNorm(dropped)
    return out


def _embed(emb: BertEmbeddings, ids: Tensor, types: Tensor | None, pos: Tensor | None) -> Tensor:
    """`BertEmbeddings`' forward on token ids (B, T): the three embeddings' sum, normalised."""
    t = ids.shape[1]
    pos = emb.position_ids[:, :t] if pos is None else pos  # (1, T) or (B, T)
    types = emb.token_type_ids[:, :t] if types is None else types  # zeros (1, T) or (B, T)
    x = emb.word_embeddings(ids) + emb.token_type_embeddings(types)  # (B, T, D)
    x = emb.LayerNorm(x + emb.position_embeddings(pos))
    return _dropout(x, emb.dropout.p, emb.training)


class FastBertModel(tf.BertModel):  # type: ignore[no-untyped-call]
    """`BertModel` with a leaner forward for the encoder's common case (module docstring)."""

    def _layers(self) -> list[BertLayer]:
        return cast("list[BertLayer]", list(self.encoder.layer))

    def _fast_path(self, mask: Any, rest: dict[str, Any]) -> bool:
        """Whether this call can skip the stock forward (it falls back on anything else)."""
        config = self.config
        layers = self._layers()
        return (
            config._attn_implementation == "sdpa"
            and not config.is_decoder
            and not config.add_cross_attention
            and config.chunk_size_feed_forward == 0
            and (mask is None or (isinstance(mask, Tensor) and mask.dim() in (2, 4)))
            and not any(layer.gradient_checkpointing for layer in layers)
            # ZeRO-3 gathers a module's weights in its forward hooks; the fused QKV reads
            # query/key/value weights without calling those modules.
            and not hasattr(layers[0].attention.self.query.weight, "ds_id")
            and _plain_output(config, rest)
        )

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """The stock forward's output: the fast path where it applies, else the stock forward."""
        stock_only = (inputs_embeds, encoder_hidden_states, encoder_attention_mask)
        if (
            input_ids is None
            or any(arg is not None for arg in stock_only)
            or past_key_values is not None
            or use_cache
            or not self._fast_path(attention_mask, kwargs)
        ):
            # By keyword: the stock forward's decorators fill `use_cache` in as a keyword.
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_attention_mask,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )
        x = _embed(self.embeddings, input_ids, token_type_ids, position_ids)  # (B, T, D)
        mask = _attend_mask(attention_mask)
        for layer in self._layers():
            x = _layer_forward(layer, x, mask)
        pooled = self.pooler(x) if self.pooler is not None else None  # (B, D)
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=x, pooler_output=pooled
        )


class FastBertForPreTraining(tf.BertForPreTraining):  # type: ignore[no-untyped-call]
    """`BertForPreTraining` whose `bert` is a `FastBertModel`; its own forward is the stock one.

    The constructor is `BertForPreTraining`'s with the encoder's class swapped: the same modules
    in the same order, then `post_init` (initialisation and the decoder's tie to the word
    embeddings), so that a seeded build equals the stock class's weight for weight.
    """

    def __init__(self, config: tf.BertConfig) -> None:
        tf.BertPreTrainedModel.__init__(self, config)
        self.bert = FastBertModel(config)
        self.cls = BertPreTrainingHeads(config)  # type: ignore[no-untyped-call]
        self.post_init()  # type: ignore[no-untyped-call]
