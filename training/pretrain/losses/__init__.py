"""The pretraining forward pass of each objective, the exported model's loss, and eval metrics.

`pretraining_loss` picks the objective's loss: the encoder ones (`training.pretrain.losses.encoder`:
masked LM, sentence pairs, ELECTRA, distillation) or the decoder ones
(`training.pretrain.losses.decoder`: causal LM, seq2seq); what they share, batch keys and the
`StepOutput` included, is `training.pretrain.losses.common`. No optimiser, data loading or
tracking lives here. Definitions are in docs/models.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import cast

import torch
import transformers as tf
from torch import Tensor, nn

from tasks.common import schema
from training.models.distill import DistillationModel
from training.models.electra import ElectraPretrainer
from training.models.models import SEQ2SEQ_OBJECTIVES, is_a
from training.pretrain.data import MASKED_POSITIONS
from training.pretrain.losses.common import IGNORE_INDEX, StepOutput, require
from training.pretrain.losses.decoder import causal_loss, seq2seq_loss
from training.pretrain.losses.encoder import (
    PAIR_LABELS,
    PAIR_NAMES,
    distill_loss,
    electra_loss,
    mlm_loss,
    pair_loss,
    rtd_loss,
)

# Token-level losses: (part name, key of its token count). Pair losses count in "pair_total".
# The first present one is the perplexity's.
_TOKEN_LOSSES = (
    ("mlm", "mlm_total"),
    ("lm", "lm_tokens"),
    ("span", "span_tokens"),
    ("denoise", "denoise_tokens"),
    ("rtd", "rtd_total"),
    ("kd", "mlm_total"),
    ("cos", "cos_total"),
)
#: Per-batch parts whose mean is not a token average (Mixtral's router balance loss).
_BATCH_LOSSES = (("aux", "aux_batches"),)


def pretraining_loss(
    model: nn.Module,
    objective: str,
    batch: Mapping[str, Tensor],
    sparse_mlm: bool = True,
) -> StepOutput:
    """Run `model` on `batch` and return the objective's loss and statistics.

    Args:
        model: A model from `training.pretrain.pretraining_model.build_pretraining_model` for this
            objective: a transformers model, an `ElectraPretrainer` or a `DistillationModel`.
        objective: bert, sop, roberta, causal, span_corruption or denoising.
        batch: int64 tensors by column name; MLM batches must hold `labels` (-100 = not
            predicted), so dynamic masking happens before this call.
        sparse_mlm: Apply the MLM head only at the masked positions (False: at every position,
            the dense reference; same loss and gradients, more compute).

    Raises:
        ValueError: unknown objective.
        KeyError: the batch lacks a column the objective needs.
    """
    if isinstance(model, ElectraPretrainer):
        return electra_loss(model, batch)
    if isinstance(model, DistillationModel):
        return distill_loss(model, batch, sparse_mlm)
    assert isinstance(model, tf.PreTrainedModel)
    if objective in PAIR_LABELS:
        return pair_loss(model, objective, batch, sparse_mlm)
    if objective == "roberta":
        return mlm_loss(model, batch, sparse_mlm)
    if objective == "causal":
        return causal_loss(model, batch)
    if objective in SEQ2SEQ_OBJECTIVES:
        return seq2seq_loss(model, SEQ2SEQ_OBJECTIVES[objective], batch)
    raise ValueError(f"unknown objective {objective!r}")


def exported_model(model: nn.Module) -> tf.PreTrainedModel:
    """The part of a pretraining model that is exported: ELECTRA's discriminator, the student."""
    if isinstance(model, ElectraPretrainer):
        return model.discriminator
    if isinstance(model, DistillationModel):
        return model.student
    assert isinstance(model, tf.PreTrainedModel)
    return model


def export_loss(
    model: nn.Module, objective: str, batch: Mapping[str, Tensor], sparse_mlm: bool = True
) -> Tensor:
    """The loss an export alone reproduces on a fixed batch (the reload check compares it).

    The full pretraining loss for a plain model; the student's MLM loss for distillation (no
    teacher in the export); for ELECTRA the discriminator's replaced-token loss on the
    uncorrupted batch (no generator in the export), every real token labelled original.
    """
    exported = exported_model(model)
    if is_a(exported, "ElectraForPreTraining"):
        require(batch, schema.INPUT_IDS, schema.LABELS)
        original = torch.where(
            batch[schema.LABELS] != IGNORE_INDEX, batch[schema.LABELS], batch[schema.INPUT_IDS]
        )
        electra = cast("tf.ElectraForPreTraining", exported)
        loss, _ = rtd_loss(electra, original, torch.zeros_like(original).float(), batch)
        return loss
    return pretraining_loss(exported, objective, batch, sparse_mlm).loss


def eval_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """Turn `StepOutput.counts` summed over an evaluation set into metrics.

    Every average is over tokens (or sentence pairs), not over batches:

    - `<part>_loss` = Σ `<part>_nll` / Σ total, for part mlm (total `mlm_total`, masked
      tokens), lm (`lm_tokens`, predicted next tokens), span / denoise (`span_tokens` /
      `denoise_tokens`, target tokens), nsp / sop (`pair_total`, pairs), rtd (`rtd_total`,
      real tokens the ELECTRA discriminator labels), kd (`mlm_total`) and cos (`cos_total`,
      real tokens) of distillation, aux (`aux_batches`: Mixtral's router loss, per batch).
    - `<part>_accuracy` = Σ `<part>_correct` / Σ total: the label's logit is the largest, a
      tie counting as a hit (kd: the student's argmax equals the teacher's; cos: cosine above
      0.9; none for aux).
    - `perplexity` = exp(the first token loss: mlm, lm, span or denoise; inf past exp's range).
    - `loss` = the sum of the part losses (BERT: mlm_loss + nsp_loss). ELECTRA and
      distillation train on a weighted sum; their `loss` here is unweighted.

    Parts whose total is absent or 0 are left out.
    """
    metrics: dict[str, float] = {}
    totals = [*_TOKEN_LOSSES, *((pair, "pair_total") for pair in PAIR_NAMES.values())]
    for name, total_key in totals:
        total = sums.get(total_key, 0.0)
        if f"{name}_nll" not in sums or total <= 0:
            continue
        metrics[f"{name}_loss"] = sums[f"{name}_nll"] / total
        metrics[f"{name}_accuracy"] = sums.get(f"{name}_correct", 0.0) / total
    for name, total_key in _BATCH_LOSSES:
        total = sums.get(total_key, 0.0)
        if f"{name}_nll" in sums and total > 0:
            metrics[f"{name}_loss"] = sums[f"{name}_nll"] / total
    token_losses = [
        metrics[f"{name}_loss"] for name, _ in _TOKEN_LOSSES if f"{name}_loss" in metrics
    ]
    if token_losses:
        metrics["perplexity"] = math.exp(token_losses[0]) if token_losses[0] < 700 else math.inf
    losses = [value for key, value in metrics.items() if key.endswith("_loss")]
    if losses:
        metrics["loss"] = sum(losses)
    return metrics


def varying_masked_positions(
    loss: Callable[[dict[str, torch.Tensor], bool], StepOutput],
) -> Callable[[dict[str, torch.Tensor], bool], StepOutput]:
    """`loss` (compiled) with a masked-LM batch's count of masked positions marked dynamic.

    The count differs from batch to batch. Unmarked, Dynamo builds a graph for the first
    batch's count, then recompiles it as dynamic at the second batch: two Inductor builds where
    one gives the same graph (the first step of a compiled bf16 BERT on CPU, twice).
    """

    def call(batch: dict[str, torch.Tensor], sparse_mlm: bool) -> StepOutput:
        positions = batch.get(MASKED_POSITIONS)
        if positions is not None:
            torch._dynamo.maybe_mark_dynamic(positions, 0)  # (M,): M varies
        return loss(batch, sparse_mlm)

    return call
