"""A vocabulary padded for the tensor cores: padding, masking the padded logits, unpadding.

Embedding and output rows are rounded up to a multiple of `model.pad_vocab_to_multiple_of`
(docs/models.md, "A vocabulary padded for the tensor cores"); the real size travels in the
transformers config while the model trains, and the export cuts the padded rows off.
"""

from __future__ import annotations

import torch
import transformers as tf
from torch import Tensor

#: The config attribute that holds the real vocabulary of a model whose rows are padded.
UNPADDED_VOCAB = "unpadded_vocab_size"


def pad_vocab(config: tf.PreTrainedConfig, multiple: int) -> None:
    """Round `config.vocab_size` up to a multiple of `multiple`, remembering the real size.

    A vocabulary size that is not a multiple of 64 sends the embedding gradient and the output
    projection (the largest matmul of a small model) to slow kernels. The real size stays in
    `config.unpadded_vocab_size` (absent when nothing was padded): the losses mask the padded
    logits with it (`mask_padded_vocab`) and the export cuts the rows off (`unpad_vocab`).
    """
    real = int(config.vocab_size)
    padded = -(-real // multiple) * multiple
    if padded != real:
        config.vocab_size = padded
        setattr(config, UNPADDED_VOCAB, real)


def mask_padded_vocab(logits: Tensor, config: tf.PreTrainedConfig) -> Tensor:
    """Give the padded vocabulary columns of `logits` (..., V) the dtype's lowest value, in place.

    Softmax then gives them exactly zero probability, so they add nothing to a loss, are never
    an argmax and are never sampled; their gradient is zero. The dtype's finite minimum rather
    than -inf keeps sums such as a KL divergence or label smoothing finite.
    """
    real = getattr(config, UNPADDED_VOCAB, None)
    if real is not None and logits.shape[-1] > real:
        logits[..., real:] = torch.finfo(logits.dtype).min
    return logits


def unpad_vocab(model: tf.PreTrainedModel) -> None:
    """Cut a padded model's embedding and output rows back to its real vocabulary, in place.

    An export then has exactly the tokenizer's rows, so `from_pretrained` + `generate` can never
    produce a padded id. Models that were never padded are left as they are.
    """
    real = getattr(model.config, UNPADDED_VOCAB, None)
    if real is None:
        return
    model.resize_token_embeddings(int(real))
    if hasattr(model.config, UNPADDED_VOCAB):
        delattr(model.config, UNPADDED_VOCAB)
