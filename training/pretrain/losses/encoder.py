"""The losses of the encoder objectives: masked LM, sentence pairs, ELECTRA and distillation.

Masked-LM logits are computed only at the masked positions (sparse MLM, as original BERT), unless
the dense reference is asked for. Models come from training/models/models.py; definitions are in
docs/models.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
import transformers as tf
from torch import Tensor, nn

from tasks.common import schema
from training.models.distill import DistillationModel
from training.models.electra import ElectraPretrainer, corrupt
from training.models.models import family_of, is_a
from training.models.vocab import mask_padded_vocab
from training.pretrain.data import MASKED_POSITIONS
from training.pretrain.losses.common import (
    ATTENTION_MASK,
    IGNORE_INDEX,
    StepOutput,
    require,
    step_output,
    token_loss,
)

PAIR_LABELS = {"bert": schema.NEXT_SENTENCE_LABEL, "sop": schema.SENTENCE_ORDER_LABEL}
#: The part name of each pair objective's loss (`nsp_loss`, `sop_loss`).
PAIR_NAMES = {"bert": "nsp", "sop": "sop"}
#: (MLM head, pair head) of the families that train a sentence-pair objective.
_PAIR_HEADS = {
    "bert": ("cls.predictions", "cls.seq_relationship"),
    "albert": ("predictions", "sop_classifier"),
}
#: The module that maps encoder hidden states to MLM logits (DistilBERT's is split in four).
_MLM_HEADS = {
    "roberta": "lm_head",
    "xlm-roberta": "lm_head",
    "longformer": "lm_head",
    "deberta-v2": "cls",
    "big_bird": "cls",
}


def _mlm_logits(
    model: tf.PreTrainedModel,
    head: str | nn.Module,
    hidden: Tensor,
    labels: Tensor,
    sparse: bool,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """MLM logits and their targets: (M, V), (M,) at masked positions, or (B·T, V), (B·T,).

    `positions` (M,): the flat indices of the masked tokens, when the batch carries them
    (`training.pretrain.data.MASKED_POSITIONS`).
    """
    module = model.get_submodule(head) if isinstance(head, str) else head

    def predict(rows: Tensor) -> Tensor:
        return mask_padded_vocab(module(rows), model.config)

    if not sparse:
        logits = predict(hidden)  # (B, T, V)
        return logits.flatten(0, 1), labels.flatten()
    if positions is not None:
        # Gathering by index needs no read on the host; boolean indexing below must first
        # count the selected rows (a device-to-host synchronisation on a GPU).
        rows = hidden.flatten(0, 1).index_select(0, positions)  # (M, D)
        return predict(rows), labels.flatten().index_select(0, positions)  # (M, V), (M,)
    selected = labels != IGNORE_INDEX  # (B, T)
    # Boolean indexing gathers the M masked rows, so the vocabulary projection, the largest
    # matmul of a small encoder, runs on ~15% of the positions (original BERT's
    # gather_indexes). Its backward scatters the gradient back to those rows.
    return predict(hidden[selected]), labels[selected]  # (M, V), (M,)


#: Encoders whose padding mask transformers builds with `masking_utils.create_bidirectional_mask`,
#: which reads the 2-D mask on the host (`mask.all()`) to see whether it can drop it.
_BIDIRECTIONAL_MASK_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "electra"})


def _padding_mask(model: tf.PreTrainedModel, mask: Tensor | None) -> Tensor | None:
    """The encoder's padding mask, as SDPA takes it where that spares a host read.

    For the `_BIDIRECTIONAL_MASK_TYPES` under SDPA, a (B, T) 0/1 mask becomes the boolean
    (B, 1, 1, T) mask transformers would build (True: attend), which it passes through as is.
    """
    config = model.config
    if (
        mask is None
        or mask.dim() != 2
        or config.model_type not in _BIDIRECTIONAL_MASK_TYPES
        or config._attn_implementation != "sdpa"
    ):
        return mask
    return mask.bool()[:, None, None, :]  # (B, 1, 1, T)


def pair_loss(
    model: tf.PreTrainedModel, objective: str, batch: Mapping[str, Tensor], sparse: bool
) -> StepOutput:
    """Masked LM plus the binary pair head: BERT's NSP/SOP head, ALBERT's SOP classifier."""
    pair_key = PAIR_LABELS[objective]
    require(batch, schema.INPUT_IDS, schema.TOKEN_TYPE_IDS, schema.LABELS, pair_key)
    mlm_head, pair_head = _PAIR_HEADS[family_of(model.config)]
    out = model.base_model(
        input_ids=batch[schema.INPUT_IDS],
        attention_mask=_padding_mask(model, batch.get(ATTENTION_MASK)),
        token_type_ids=batch[schema.TOKEN_TYPE_IDS],
    )
    hidden = out.last_hidden_state  # (B, T, D)
    positions = batch.get(MASKED_POSITIONS)
    logits, targets = _mlm_logits(model, mlm_head, hidden, batch[schema.LABELS], sparse, positions)
    mlm, counts = token_loss(logits, targets, "mlm", "mlm_total")
    pair_logits = model.get_submodule(pair_head)(out.pooler_output)  # (B, 2)
    name = PAIR_NAMES[objective]
    pair, pair_counts = token_loss(pair_logits, batch[pair_key].long(), name, "pair_total")
    return step_output({"mlm": mlm, name: pair}, counts | pair_counts, batch)


def _distilbert_head(model: tf.DistilBertForMaskedLM) -> nn.Module:
    """DistilBERT's MLM head (transform, activation, LayerNorm, projection) as one module."""
    return nn.Sequential(
        model.vocab_transform, model.activation, model.vocab_layer_norm, model.vocab_projector
    )


def mlm_hidden_and_logits(
    model: tf.PreTrainedModel, batch: Mapping[str, Tensor], sparse: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Last hidden states (B, T, D) and MLM logits and targets of any single-segment encoder."""
    require(batch, schema.INPUT_IDS, schema.LABELS)
    ids = batch[schema.INPUT_IDS]
    extra = {}
    if is_a(model, "LongformerForMaskedLM"):
        # Global attention on the first token (<s>), so the global projections a fine-tuned
        # classifier uses for it are trained too; every other token attends locally.
        extra["global_attention_mask"] = F.pad(
            torch.ones_like(ids[:, :1]), (0, ids.shape[1] - 1), value=0
        )
    mask = _padding_mask(model, batch.get(ATTENTION_MASK))
    out = model.base_model(input_ids=ids, attention_mask=mask, **extra)
    hidden = out.last_hidden_state  # (B, T, D)
    head: nn.Module | str
    if is_a(model, "DistilBertForMaskedLM"):
        head = _distilbert_head(cast("tf.DistilBertForMaskedLM", model))
    elif is_a(model, "ElectraForMaskedLM"):  # ELECTRA's generator
        generator = cast("tf.ElectraForMaskedLM", model)
        head = nn.Sequential(generator.generator_predictions, generator.generator_lm_head)
    else:
        head = _MLM_HEADS[family_of(model.config)]
    positions = batch.get(MASKED_POSITIONS)
    logits, targets = _mlm_logits(model, head, hidden, batch[schema.LABELS], sparse, positions)
    return hidden, logits, targets


def mlm_loss(model: tf.PreTrainedModel, batch: Mapping[str, Tensor], sparse: bool) -> StepOutput:
    """Masked LM only (RoBERTa, XLM-R, DistilBERT, DeBERTa, Longformer, BigBird)."""
    _, logits, targets = mlm_hidden_and_logits(model, batch, sparse)
    mlm, counts = token_loss(logits, targets, "mlm", "mlm_total")
    return step_output({"mlm": mlm}, counts, batch)


def rtd_loss(
    discriminator: tf.ElectraForPreTraining,
    input_ids: Tensor,
    labels: Tensor,
    batch: Mapping[str, Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Replaced-token detection: mean binary cross-entropy over the real tokens, and its sums."""
    mask = batch.get(ATTENTION_MASK)
    real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    logits = discriminator(input_ids=input_ids, attention_mask=mask).logits  # (B, T)
    nll = F.binary_cross_entropy_with_logits(logits.float()[real], labels[real], reduction="sum")
    total = real.sum()
    with torch.no_grad():
        correct = ((logits[real] > 0).float() == labels[real]).sum()
    counts = {"rtd_nll": nll.detach(), "rtd_correct": correct, "rtd_total": total}
    return nll / total.clamp(min=1), counts


def electra_loss(model: ElectraPretrainer, batch: Mapping[str, Tensor]) -> StepOutput:
    """Generator MLM + `rtd_weight` x discriminator RTD on the generator's samples.

    In eval mode the samples use a fixed seed, so held-out losses are comparable over steps.
    `parts` and the metrics hold both losses unweighted; `loss` is the weighted sum trained on.
    """
    generator = model.generator
    _, logits, targets = mlm_hidden_and_logits(generator, batch, sparse=True)
    mlm, counts = token_loss(logits, targets, "mlm", "mlm_total")
    rng = None
    if not model.training:
        rng = torch.Generator(device=logits.device).manual_seed(0x5EED)
    sample = corrupt(batch[schema.INPUT_IDS], batch[schema.LABELS], logits, model.temperature, rng)
    rtd, rtd_counts = rtd_loss(model.discriminator, sample.input_ids, sample.labels, batch)
    out = step_output({"mlm": mlm, "rtd": rtd}, counts | rtd_counts, batch)
    return StepOutput(mlm + model.rtd_weight * rtd, out.parts, out.counts)


def distill_loss(model: DistillationModel, batch: Mapping[str, Tensor], sparse: bool) -> StepOutput:
    """DistilBERT's triple loss (Sanh et al. 2019), weighted by `train.distillation`.

    alpha_kd x T^2 x KL(teacher || student) at the masked positions, plus alpha_mlm x the
    student's MLM loss, plus alpha_cos x (1 - cosine) of the last hidden states at real tokens.
    """
    cfg = model.settings
    hidden, logits, targets = mlm_hidden_and_logits(model.student, batch, sparse)
    mlm, counts = token_loss(logits, targets, "mlm", "mlm_total")
    teacher = model.teacher
    with torch.no_grad():
        t_out = teacher.bert(
            input_ids=batch[schema.INPUT_IDS], attention_mask=batch.get(ATTENTION_MASK)
        )
        t_logits, _ = _mlm_logits(
            teacher, "cls.predictions", t_out.last_hidden_state, batch[schema.LABELS], sparse
        )
    selected = targets != IGNORE_INDEX  # (M,) or (B·T,)
    temp = cfg.temperature
    s_log = F.log_softmax(logits[selected].float() / temp, dim=-1)
    t_prob = F.softmax(t_logits[selected].float() / temp, dim=-1)
    kd_sum = F.kl_div(s_log, t_prob, reduction="sum") * temp**2
    total = counts["mlm_total"]
    kd = kd_sum / total.clamp(min=1)
    mask = batch.get(ATTENTION_MASK)
    real = (
        torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        if mask is None or mask.dim() != 2
        else mask.bool()
    )
    cosine = F.cosine_similarity(hidden[real].float(), t_out.last_hidden_state[real].float(), -1)
    cos_sum = (1.0 - cosine).sum()
    cos_total = real.sum()
    cos = cos_sum / cos_total.clamp(min=1)
    counts |= {
        "kd_nll": kd_sum.detach(),
        "kd_correct": ((logits[selected].argmax(-1) == t_logits[selected].argmax(-1)).sum()),
        "cos_nll": cos_sum.detach(),
        "cos_correct": (cosine > 0.9).sum(),
        "cos_total": cos_total,
    }
    out = step_output({"mlm": mlm, "kd": kd, "cos": cos}, counts, batch)
    loss = cfg.alpha_kd * kd + cfg.alpha_mlm * mlm + cfg.alpha_cos * cos
    return StepOutput(loss, out.parts, out.counts)
