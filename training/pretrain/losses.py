"""The pretraining forward pass of each objective, its metrics, and FLOPs per token for MFU.

A batch is a dict of int64 tensors keyed by the example stage's column names (`tasks.common.schema`)
plus `attention_mask`, and for document-masked causal blocks `position_ids` and `document_ids`,
from which the 4-D additive mask is built on the device (training/pretrain/packing.py); a
4-D `attention_mask` given instead is used as is. Masked-LM logits are computed only at the
masked positions (sparse MLM, as original BERT). Models come from training/models/models.py; no
optimiser, data loading or tracking lives here. Definitions are in docs/models.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers as tf
from torch import Tensor, nn

from tasks.common import schema
from training.models.distill import DistillationModel
from training.models.electra import ElectraPretrainer, corrupt
from training.models.models import family_of
from training.models.vocab import mask_padded_vocab
from training.pretrain.data import DOCUMENT_IDS, MASKED_POSITIONS
from training.pretrain.packing import causal_document_mask

ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
IGNORE_INDEX = -100  # labels of positions that are not predicted
MLM_OBJECTIVES = ("bert", "sop", "roberta")
SEQ2SEQ_OBJECTIVES = {"span_corruption": "span", "denoising": "denoise"}
PAIR_LABELS = {"bert": schema.NEXT_SENTENCE_LABEL, "sop": schema.SENTENCE_ORDER_LABEL}
_PAIR_NAMES = {"bert": "nsp", "sop": "sop"}
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


@dataclass(frozen=True)
class StepOutput:
    """One forward pass: the loss to backpropagate and detached per-batch statistics.

    Attributes:
        loss: Scalar with grad; the sum of the objective's mean parts (BERT: MLM + NSP).
        parts: Detached per-batch means: `mlm_loss`, `nsp_loss`/`sop_loss`, `lm_loss`,
            `span_loss`.
        counts: Detached sums to add up over batches for `eval_metrics`: `<part>_nll` (summed
            negative log-likelihood, float), `<part>_correct` (argmax hits), the totals
            `mlm_total`, `pair_total`, `lm_tokens`, `span_tokens`, and `input_tokens` (real,
            non-padding input tokens, for tokens/s).
    """

    loss: Tensor
    parts: dict[str, Tensor]
    counts: dict[str, Tensor]


def pretraining_loss(
    model: nn.Module,
    objective: str,
    batch: Mapping[str, Tensor],
    sparse_mlm: bool = True,
) -> StepOutput:
    """Run `model` on `batch` and return the objective's loss and statistics.

    Args:
        model: A model from `training.models.pretraining_model.build_pretraining_model` for this
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
        return _electra_loss(model, batch)
    if isinstance(model, DistillationModel):
        return _distill_loss(model, batch, sparse_mlm)
    assert isinstance(model, tf.PreTrainedModel)
    if objective in PAIR_LABELS:
        return _pair_loss(model, objective, batch, sparse_mlm)
    if objective == "roberta":
        return _mlm_loss(model, batch, sparse_mlm)
    if objective == "causal":
        return _causal_loss(model, batch)
    if objective in SEQ2SEQ_OBJECTIVES:
        return _seq2seq_loss(model, SEQ2SEQ_OBJECTIVES[objective], batch)
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
    if isinstance(exported, tf.ElectraForPreTraining):
        _require(batch, schema.INPUT_IDS, schema.LABELS)
        original = torch.where(
            batch[schema.LABELS] != IGNORE_INDEX, batch[schema.LABELS], batch[schema.INPUT_IDS]
        )
        loss, _ = _rtd(exported, original, torch.zeros_like(original).float(), batch)
        return loss
    return pretraining_loss(exported, objective, batch, sparse_mlm).loss


def _require(batch: Mapping[str, Tensor], *names: str) -> None:
    missing = [name for name in names if name not in batch]
    if missing:
        raise KeyError(f"batch lacks {missing} (has {sorted(batch)})")


def _token_loss(
    logits: Tensor, targets: Tensor, name: str, total_key: str
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean cross-entropy over targets != -100 and its detached sums.

    `logits` (N, C) and `targets` (N,). Summing, then dividing by the count, equals
    `F.cross_entropy`'s mean but gives 0 instead of NaN when nothing is predicted.
    """
    valid = targets != IGNORE_INDEX  # (N,)
    nll = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    total = valid.sum()
    with torch.no_grad():
        correct = ((logits.argmax(dim=-1) == targets) & valid).sum()
    counts = {f"{name}_nll": nll.detach(), f"{name}_correct": correct, total_key: total}
    return nll / total.clamp(min=1), counts


def _input_tokens(batch: Mapping[str, Tensor]) -> Tensor:
    """Real input tokens: the 2-D padding mask's sum; every slot for 4-D-masked full blocks."""
    mask = batch.get(ATTENTION_MASK)
    if mask is not None and mask.dim() == 2:
        return mask.sum()
    ids = batch[schema.INPUT_IDS]
    # A fill on the device: `torch.tensor(n, device=...)` would copy from the host and wait.
    return torch.full((), ids.numel(), dtype=torch.int64, device=ids.device)


def _step(
    losses: dict[str, Tensor], counts: dict[str, Tensor], batch: Mapping[str, Tensor]
) -> StepOutput:
    """Sum the parts into the loss, detach them, and add the input token count."""
    loss = torch.stack(list(losses.values())).sum()
    parts = {f"{name}_loss": value.detach() for name, value in losses.items()}
    return StepOutput(loss, parts, counts | {"input_tokens": _input_tokens(batch)})


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


def _pair_loss(
    model: tf.PreTrainedModel, objective: str, batch: Mapping[str, Tensor], sparse: bool
) -> StepOutput:
    """Masked LM plus the binary pair head: BERT's NSP/SOP head, ALBERT's SOP classifier."""
    pair_key = PAIR_LABELS[objective]
    _require(batch, schema.INPUT_IDS, schema.TOKEN_TYPE_IDS, schema.LABELS, pair_key)
    mlm_head, pair_head = _PAIR_HEADS[family_of(model.config)]
    out = model.base_model(
        input_ids=batch[schema.INPUT_IDS],
        attention_mask=_padding_mask(model, batch.get(ATTENTION_MASK)),
        token_type_ids=batch[schema.TOKEN_TYPE_IDS],
    )
    hidden = out.last_hidden_state  # (B, T, D)
    positions = batch.get(MASKED_POSITIONS)
    logits, targets = _mlm_logits(model, mlm_head, hidden, batch[schema.LABELS], sparse, positions)
    mlm, counts = _token_loss(logits, targets, "mlm", "mlm_total")
    pair_logits = model.get_submodule(pair_head)(out.pooler_output)  # (B, 2)
    name = _PAIR_NAMES[objective]
    pair, pair_counts = _token_loss(pair_logits, batch[pair_key].long(), name, "pair_total")
    return _step({"mlm": mlm, name: pair}, counts | pair_counts, batch)


def _distilbert_head(model: tf.DistilBertForMaskedLM) -> nn.Module:
    """DistilBERT's MLM head (transform, activation, LayerNorm, projection) as one module."""
    return nn.Sequential(
        model.vocab_transform, model.activation, model.vocab_layer_norm, model.vocab_projector
    )


def mlm_hidden_and_logits(
    model: tf.PreTrainedModel, batch: Mapping[str, Tensor], sparse: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Last hidden states (B, T, D) and MLM logits and targets of any single-segment encoder."""
    _require(batch, schema.INPUT_IDS, schema.LABELS)
    ids = batch[schema.INPUT_IDS]
    extra = {}
    if isinstance(model, tf.LongformerForMaskedLM):
        # Global attention on the first token (<s>), so the global projections a fine-tuned
        # classifier uses for it are trained too; every other token attends locally.
        extra["global_attention_mask"] = F.pad(
            torch.ones_like(ids[:, :1]), (0, ids.shape[1] - 1), value=0
        )
    mask = _padding_mask(model, batch.get(ATTENTION_MASK))
    out = model.base_model(input_ids=ids, attention_mask=mask, **extra)
    hidden = out.last_hidden_state  # (B, T, D)
    head: nn.Module | str
    if isinstance(model, tf.DistilBertForMaskedLM):
        head = _distilbert_head(model)
    elif isinstance(model, tf.ElectraForMaskedLM):  # ELECTRA's generator
        head = nn.Sequential(model.generator_predictions, model.generator_lm_head)
    else:
        head = _MLM_HEADS[family_of(model.config)]
    positions = batch.get(MASKED_POSITIONS)
    logits, targets = _mlm_logits(model, head, hidden, batch[schema.LABELS], sparse, positions)
    return hidden, logits, targets


def _mlm_loss(model: tf.PreTrainedModel, batch: Mapping[str, Tensor], sparse: bool) -> StepOutput:
    """Masked LM only (RoBERTa, XLM-R, DistilBERT, DeBERTa, Longformer, BigBird)."""
    _, logits, targets = mlm_hidden_and_logits(model, batch, sparse)
    mlm, counts = _token_loss(logits, targets, "mlm", "mlm_total")
    return _step({"mlm": mlm}, counts, batch)


def _rtd(
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


def _electra_loss(model: ElectraPretrainer, batch: Mapping[str, Tensor]) -> StepOutput:
    """Generator MLM + `rtd_weight` x discriminator RTD on the generator's samples.

    In eval mode the samples use a fixed seed, so held-out losses are comparable over steps.
    `parts` and the metrics hold both losses unweighted; `loss` is the weighted sum trained on.
    """
    generator = model.generator
    _, logits, targets = mlm_hidden_and_logits(generator, batch, sparse=True)
    mlm, counts = _token_loss(logits, targets, "mlm", "mlm_total")
    rng = None
    if not model.training:
        rng = torch.Generator(device=logits.device).manual_seed(0x5EED)
    sample = corrupt(batch[schema.INPUT_IDS], batch[schema.LABELS], logits, model.temperature, rng)
    rtd, rtd_counts = _rtd(model.discriminator, sample.input_ids, sample.labels, batch)
    out = _step({"mlm": mlm, "rtd": rtd}, counts | rtd_counts, batch)
    return StepOutput(mlm + model.rtd_weight * rtd, out.parts, out.counts)


def _distill_loss(
    model: DistillationModel, batch: Mapping[str, Tensor], sparse: bool
) -> StepOutput:
    """DistilBERT's triple loss (Sanh et al. 2019), weighted by `train.distillation`.

    alpha_kd x T^2 x KL(teacher || student) at the masked positions, plus alpha_mlm x the
    student's MLM loss, plus alpha_cos x (1 - cosine) of the last hidden states at real tokens.
    """
    cfg = model.settings
    hidden, logits, targets = mlm_hidden_and_logits(model.student, batch, sparse)
    mlm, counts = _token_loss(logits, targets, "mlm", "mlm_total")
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
    out = _step({"mlm": mlm, "kd": kd, "cos": cos}, counts, batch)
    loss = cfg.alpha_kd * kd + cfg.alpha_mlm * mlm + cfg.alpha_cos * cos
    return StepOutput(loss, out.parts, out.counts)


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
    _require(batch, schema.INPUT_IDS)
    extra = {"output_router_logits": True} if router_loss else {}
    mask = batch.get(ATTENTION_MASK)
    if DOCUMENT_IDS in batch:  # built here, on the batch's device, in the model's dtype
        mask = causal_document_mask(batch[DOCUMENT_IDS], model.dtype)
    out = model(
        input_ids=batch[schema.INPUT_IDS],
        attention_mask=_model_mask(
            mask, model.dtype, getattr(model.config, "sliding_window", None)
        ),
        position_ids=batch.get(POSITION_IDS),
        use_cache=False,  # training: no KV cache (and none under activation checkpointing)
        **extra,
    )
    logits = mask_padded_vocab(out.logits, model.config)
    return logits, getattr(out, "aux_loss", None) if router_loss else None


def _causal_loss(model: tf.PreTrainedModel, batch: Mapping[str, Tensor]) -> StepOutput:
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
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # (B, T): token t + 1
    lm, counts = _token_loss(logits.flatten(0, 1), targets.flatten(), "lm", "lm_tokens")
    if aux is None:
        return _step({"lm": lm}, counts, batch)
    aux = aux * float(model.config.router_aux_loss_coef)
    counts |= {"aux_nll": aux.detach(), "aux_batches": torch.ones((), device=aux.device)}
    return _step({"lm": lm, "aux": aux}, counts, batch)


def _seq2seq_loss(model: tf.PreTrainedModel, name: str, batch: Mapping[str, Tensor]) -> StepOutput:
    """T5 span corruption or BART denoising: decoder cross-entropy on the targets.

    Pad ids in `labels` are not predicted; the encoder's padding is masked by
    `attention_mask`.
    """
    _require(batch, schema.INPUT_IDS, schema.DECODER_INPUT_IDS, schema.LABELS)
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
    loss, counts = _token_loss(logits.flatten(0, 1), labels.flatten(), name, f"{name}_tokens")
    return _step({name: loss}, counts, batch)


def eval_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """Turn `StepOutput.counts` summed over an evaluation set into metrics.

    Every average is over tokens (or sentence pairs), not over batches:

    - `<part>_loss` = Σ `<part>_nll` / Σ total, for part mlm (total `mlm_total`, masked
      tokens), lm (`lm_tokens`, predicted next tokens), span / denoise (`span_tokens` /
      `denoise_tokens`, target tokens), nsp / sop (`pair_total`, pairs), rtd (`rtd_total`,
      real tokens the ELECTRA discriminator labels), kd (`mlm_total`) and cos (`cos_total`,
      real tokens) of distillation, aux (`aux_batches`: Mixtral's router loss, per batch).
    - `<part>_accuracy` = Σ `<part>_correct` / Σ total: argmax equals the label (kd: the
      student's argmax equals the teacher's; cos: cosine above 0.9; none for aux).
    - `perplexity` = exp(the first token loss: mlm, lm, span or denoise; inf past exp's range).
    - `loss` = the sum of the part losses (BERT: mlm_loss + nsp_loss). ELECTRA and
      distillation train on a weighted sum; their `loss` here is unweighted.

    Parts whose total is absent or 0 are left out.
    """
    metrics: dict[str, float] = {}
    totals = [*_TOKEN_LOSSES, *((pair, "pair_total") for pair in _PAIR_NAMES.values())]
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
