"""The losses of the decoder objectives: causal LM (GPT, Llama, Mistral, Mixtral) and seq2seq.

Document-masked causal blocks carry `document_ids`, from which the attention mask is built on
the device (training/pretrain/packing.py): a FlexAttention block mask for a model that attends
through FlexAttention (`train.attention` flex, training/models/attention.py), else the 4-D
additive mask; a 4-D `attention_mask` given instead is used as is.
Seq2seq is T5's span corruption and BART's denoising: decoder cross-entropy on the targets.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
import transformers as tf
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from tasks.common import schema
from training.models.attention import uses_document_flex
from training.models.vocab import mask_padded_vocab
from training.pretrain.data import DOCUMENT_IDS
from training.pretrain.losses.common import (
    ATTENTION_MASK,
    IGNORE_INDEX,
    POSITION_IDS,
    StepOutput,
    require,
    step_output,
    token_loss,
)
from training.pretrain.packing import causal_document_mask, document_block_mask


def _model_mask(
    mask: Tensor | None, dtype: torch.dtype, window: int | None = None
) -> Tensor | None:
    """Pass a 2-D padding mask as is; give a 4-D additive mask the model's dtype and window.

    The mask is added to the attention scores, which are in the model's dtype (bf16 under
    DeepSpeed); fused SDPA kernels may insist on that dtype. Rebuilding rather than casting
    keeps blocked entries at the dtype's finite minimum (a float32 minimum rounds to -inf in
    bf16), as transformers' own masks do. transformers uses a custom 4-D mask as given, so a
    sliding-window model (Mistral, Mixtral) would attend past its `window` under document
    masking: keys `window` or more positions back are blocked here, as its own mask does.
    """
    if mask is None or mask.dim() != 4 or (mask.dtype == dtype and not window):
        return mask
    blocked = mask < 0  # (B, 1, T, T)
    if window:
        pos = torch.arange(mask.shape[-1], device=mask.device)
        blocked = blocked | ((pos[:, None] - pos[None, :]) >= window)  # (T, T) broadcast
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        blocked, torch.finfo(dtype).min
    )


def _attention_mask(
    model: tf.PreTrainedModel, batch: Mapping[str, Tensor]
) -> Tensor | BlockMask | None:
    """The mask the model gets: built here from `document_ids`, on the batch's device."""
    window = getattr(model.config, "sliding_window", None)
    if DOCUMENT_IDS not in batch:
        return _model_mask(batch.get(ATTENTION_MASK), model.dtype, window)
    documents = batch[DOCUMENT_IDS]  # (B, L)
    if uses_document_flex(model.config):
        return document_block_mask(documents, window)
    return _model_mask(causal_document_mask(documents, model.dtype), model.dtype, window)


def causal_logits(model: tf.PreTrainedModel, batch: Mapping[str, Tensor]) -> Tensor:
    """(B, T, V) next-token logits, honouring document `position_ids` and a 4-D mask if given.

    With a 4-D mask (transformers 5 returns it as-is from `create_causal_mask`) a token attends
    only to earlier tokens of its own document. Without one, a 2-D mask gives plain causal
    attention over the whole block.
    """
    return _causal_forward(model, batch, router_loss=False)[0]


def _causal_forward(
    model: tf.PreTrainedModel, batch: Mapping[str, Tensor], router_loss: bool
) -> tuple[Tensor, Tensor | None]:
    """`causal_logits`, plus the router's load-balancing loss of a mixture of experts."""
    require(batch, schema.INPUT_IDS)
    inputs = {
        "input_ids": batch[schema.INPUT_IDS],
        "attention_mask": _attention_mask(model, batch),
        "position_ids": batch.get(POSITION_IDS),
        "use_cache": False,  # training: no KV cache (and none under activation checkpointing)
    }
    if router_loss and DOCUMENT_IDS in batch:
        return _experts_on_documents(model, inputs)
    # A fast class computes them without the module call (training/models/fast/gpt2.py).
    direct = None if router_loss else getattr(model, "pretraining_logits", None)
    if direct is not None:
        logits = direct(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"])
        if logits is not None:
            return mask_padded_vocab(logits, model.config), None
    extra = {"output_router_logits": True} if router_loss else {}
    out = model(**inputs, **extra)
    logits = mask_padded_vocab(out.logits, model.config)
    return logits, getattr(out, "aux_loss", None) if router_loss else None


def _experts_on_documents(
    model: tf.PreTrainedModel, inputs: Mapping[str, object]
) -> tuple[Tensor, Tensor]:
    """Mixtral's logits and load-balancing loss on a document-masked block.

    `MixtralForCausalLM` weighs its balance loss by `attention_mask` read as a (B, T) padding
    mask, which a document mask (4-D, or a block mask) is not: it fails on one. A packed block
    has no padding, so the base model runs here and the loss counts every token, as the
    model's own does without a mask.
    """
    # Here, not at the top: Mixtral's modeling module is for Mixtral runs only.
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    out = model.model(**inputs, output_router_logits=True)
    logits = mask_padded_vocab(model.lm_head(out.last_hidden_state), model.config)  # (B, T, V)
    experts, top_k = model.config.num_local_experts, model.config.num_experts_per_tok
    aux = load_balancing_loss_func(out.router_logits, experts, top_k, None)
    assert isinstance(aux, Tensor)  # an int only when there are no router logits
    return logits, aux


def causal_loss(model: tf.PreTrainedModel, batch: Mapping[str, Tensor]) -> StepOutput:
    """Next-token loss at every position of the block (padding excluded).

    A sparse mixture of experts (Mixtral) adds its router's load-balancing loss times
    `router_aux_loss_coef` as the part `aux`, so the experts stay in use.
    """
    moe = isinstance(model.config, tf.MixtralConfig)
    logits, aux = _causal_forward(model, batch, router_loss=moe)  # (B, T, V)
    labels = batch[schema.INPUT_IDS]  # (B, T)
    mask = batch.get(ATTENTION_MASK)
    if mask is not None and mask.dim() == 2:
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    # Shift the labels, not the logits (as transformers' ForCausalLMLoss): no (B, T, V) copy.
    # Padded after the slice, the targets come out contiguous: flattening them copies nothing.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T): token t + 1
    lm, counts = token_loss(logits.flatten(0, 1), targets.flatten(), "lm", "lm_tokens")
    if aux is None:
        return step_output({"lm": lm}, counts, batch)
    aux = aux * float(model.config.router_aux_loss_coef)
    counts |= {"aux_nll": aux.detach(), "aux_batches": torch.ones((), device=aux.device)}
    return step_output({"lm": lm, "aux": aux}, counts, batch)


def seq2seq_loss(model: tf.PreTrainedModel, name: str, batch: Mapping[str, Tensor]) -> StepOutput:
    """T5 span corruption or BART denoising: decoder cross-entropy on the targets.

    Pad ids in `labels` are not predicted; the encoder's padding is masked by
    `attention_mask`.
    """
    require(batch, schema.INPUT_IDS, schema.DECODER_INPUT_IDS, schema.LABELS)
    out = model(
        input_ids=batch[schema.INPUT_IDS],
        attention_mask=batch.get(ATTENTION_MASK),
        decoder_input_ids=batch[schema.DECODER_INPUT_IDS],
        use_cache=False,
    )
    logits = mask_padded_vocab(out.logits, model.config)  # (B, S, V)
    labels = batch[schema.LABELS]  # (B, S)
    pad = model.config.pad_token_id
    if pad is not None:
        labels = labels.masked_fill(labels == pad, IGNORE_INDEX)
    loss, counts = token_loss(logits.flatten(0, 1), labels.flatten(), name, f"{name}_tokens")
    return step_output({name: loss}, counts, batch)
