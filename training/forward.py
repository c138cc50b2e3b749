"""The pretraining forward pass of each objective, its metrics, and FLOPs per token for MFU.

A batch is a dict of int64 tensors keyed by the example stage's column names (`tasks.schema`)
plus `attention_mask`, and for document-masked causal blocks `position_ids` and a 4-D additive
mask (training/packing.py). Masked-LM logits are computed only at the masked positions (sparse
MLM, as original BERT). Models come from training/models.py; no optimiser, data loading or
tracking lives here. Definitions are in docs/models.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers as tf
from torch import Tensor, nn

from tasks import schema
from training.models import family_of, model_class

ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
IGNORE_INDEX = -100  # labels of positions that are not predicted
MLM_OBJECTIVES = ("bert", "sop", "roberta")
PAIR_LABELS = {"bert": schema.NEXT_SENTENCE_LABEL, "sop": schema.SENTENCE_ORDER_LABEL}
_PAIR_NAMES = {"bert": "nsp", "sop": "sop"}
# Token-level losses: (part name, key of its token count). Pair losses count in "pair_total".
#: The vocabulary projection of each family (tied to the input embedding except for llama).
_OUTPUT_LAYER = {
    "bert": "cls.predictions.decoder",
    "roberta": "lm_head.decoder",
    "gpt2": "lm_head",
    "llama": "lm_head",
    "t5": "lm_head",
}
_TOKEN_LOSSES = (("mlm", "mlm_total"), ("lm", "lm_tokens"), ("span", "span_tokens"))


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
    model: tf.PreTrainedModel,
    objective: str,
    batch: Mapping[str, Tensor],
    sparse_mlm: bool = True,
) -> StepOutput:
    """Run `model` on `batch` and return the objective's loss and statistics.

    Args:
        model: A model from `training.models.build_model` for this objective.
        objective: bert, sop, roberta, causal or span_corruption.
        batch: int64 tensors by column name; MLM batches must hold `labels` (-100 = not
            predicted), so dynamic masking happens before this call.
        sparse_mlm: Apply the MLM head only at the masked positions (False: at every position,
            the dense reference; same loss and gradients, more compute).

    Raises:
        ValueError: unknown objective.
        KeyError: the batch lacks a column the objective needs.
    """
    if objective in PAIR_LABELS:
        return _bert_loss(model, objective, batch, sparse_mlm)
    if objective == "roberta":
        return _roberta_loss(model, batch, sparse_mlm)
    if objective == "causal":
        return _causal_loss(model, batch)
    if objective == "span_corruption":
        return _span_loss(model, batch)
    raise ValueError(f"unknown objective {objective!r}")


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
    return torch.tensor(batch[schema.INPUT_IDS].numel(), device=batch[schema.INPUT_IDS].device)


def _step(
    losses: dict[str, Tensor], counts: dict[str, Tensor], batch: Mapping[str, Tensor]
) -> StepOutput:
    """Sum the parts into the loss, detach them, and add the input token count."""
    loss = torch.stack(list(losses.values())).sum()
    parts = {f"{name}_loss": value.detach() for name, value in losses.items()}
    return StepOutput(loss, parts, counts | {"input_tokens": _input_tokens(batch)})


def _mlm_logits(
    model: tf.PreTrainedModel, head: str, hidden: Tensor, labels: Tensor, sparse: bool
) -> tuple[Tensor, Tensor]:
    """MLM logits and their targets: (M, V), (M,) at masked positions, or (B·T, V), (B·T,)."""
    predict = model.get_submodule(head)
    if not sparse:
        logits = predict(hidden)  # (B, T, V)
        return logits.flatten(0, 1), labels.flatten()
    selected = labels != IGNORE_INDEX  # (B, T)
    # Boolean indexing gathers the M masked rows, so the vocabulary projection, the largest
    # matmul of a small encoder, runs on ~15% of the positions (original BERT's
    # gather_indexes). Its backward scatters the gradient back to those rows.
    return predict(hidden[selected]), labels[selected]  # (M, V), (M,)


def _bert_loss(
    model: tf.PreTrainedModel, objective: str, batch: Mapping[str, Tensor], sparse: bool
) -> StepOutput:
    """Masked LM plus the binary pair head (NSP for bert, SOP for sop) of BertForPreTraining."""
    pair_key = PAIR_LABELS[objective]
    _require(batch, schema.INPUT_IDS, schema.TOKEN_TYPE_IDS, schema.LABELS, pair_key)
    out = model.base_model(
        input_ids=batch[schema.INPUT_IDS],
        attention_mask=batch.get(ATTENTION_MASK),
        token_type_ids=batch[schema.TOKEN_TYPE_IDS],
    )
    hidden = out.last_hidden_state  # (B, T, D)
    logits, targets = _mlm_logits(model, "cls.predictions", hidden, batch[schema.LABELS], sparse)
    mlm, counts = _token_loss(logits, targets, "mlm", "mlm_total")
    pair_logits = model.get_submodule("cls.seq_relationship")(out.pooler_output)  # (B, 2)
    name = _PAIR_NAMES[objective]
    pair, pair_counts = _token_loss(pair_logits, batch[pair_key].long(), name, "pair_total")
    return _step({"mlm": mlm, name: pair}, counts | pair_counts, batch)


def _roberta_loss(
    model: tf.PreTrainedModel, batch: Mapping[str, Tensor], sparse: bool
) -> StepOutput:
    """Masked LM only (RobertaForMaskedLM has no pooler and no pair head)."""
    _require(batch, schema.INPUT_IDS, schema.LABELS)
    out = model.base_model(
        input_ids=batch[schema.INPUT_IDS], attention_mask=batch.get(ATTENTION_MASK)
    )
    hidden = out.last_hidden_state  # (B, T, D)
    logits, targets = _mlm_logits(model, "lm_head", hidden, batch[schema.LABELS], sparse)
    mlm, counts = _token_loss(logits, targets, "mlm", "mlm_total")
    return _step({"mlm": mlm}, counts, batch)


def _model_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Pass a 2-D padding mask as is; give a 4-D additive mask the model's dtype.

    The mask is added to the attention scores, which are in the model's dtype (bf16 under
    DeepSpeed); fused SDPA kernels may insist on that dtype. Rebuilding rather than casting
    keeps blocked entries at the dtype's finite minimum (a float32 minimum rounds to -inf in
    bf16), as transformers' own masks do.
    """
    if mask is None or mask.dim() != 4 or mask.dtype == dtype:
        return mask
    blocked = mask < 0  # (B, 1, T, T)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        blocked, torch.finfo(dtype).min
    )


def causal_logits(model: tf.PreTrainedModel, batch: Mapping[str, Tensor]) -> Tensor:
    """(B, T, V) next-token logits, honouring document `position_ids` and a 4-D mask if given.

    With a 4-D mask (transformers 5 returns it as-is from `create_causal_mask`) a token attends
    only to earlier tokens of its own document. Without one, a 2-D mask gives plain causal
    attention over the whole block.
    """
    _require(batch, schema.INPUT_IDS)
    out = model(
        input_ids=batch[schema.INPUT_IDS],
        attention_mask=_model_mask(batch.get(ATTENTION_MASK), model.dtype),
        position_ids=batch.get(POSITION_IDS),
        use_cache=False,  # training: no KV cache (and none under activation checkpointing)
    )
    logits: Tensor = out.logits
    return logits


def _causal_loss(model: tf.PreTrainedModel, batch: Mapping[str, Tensor]) -> StepOutput:
    """Next-token loss at every position of the block (padding excluded)."""
    logits = causal_logits(model, batch)  # (B, T, V)
    labels = batch[schema.INPUT_IDS]  # (B, T)
    mask = batch.get(ATTENTION_MASK)
    if mask is not None and mask.dim() == 2:
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    # Shift the labels, not the logits (as transformers' ForCausalLMLoss): no (B, T, V) copy.
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # (B, T): token t + 1
    lm, counts = _token_loss(logits.flatten(0, 1), targets.flatten(), "lm", "lm_tokens")
    return _step({"lm": lm}, counts, batch)


def _span_loss(model: tf.PreTrainedModel, batch: Mapping[str, Tensor]) -> StepOutput:
    """T5 span corruption: decoder cross-entropy on the targets (pad ids not predicted)."""
    _require(batch, schema.INPUT_IDS, schema.DECODER_INPUT_IDS, schema.LABELS)
    out = model(
        input_ids=batch[schema.INPUT_IDS],
        attention_mask=batch.get(ATTENTION_MASK),
        decoder_input_ids=batch[schema.DECODER_INPUT_IDS],
        use_cache=False,
    )
    logits = out.logits  # (B, S, V)
    labels = batch[schema.LABELS]  # (B, S)
    pad = model.config.pad_token_id
    if pad is not None:
        labels = labels.masked_fill(labels == pad, IGNORE_INDEX)
    span, counts = _token_loss(logits.flatten(0, 1), labels.flatten(), "span", "span_tokens")
    return _step({"span": span}, counts, batch)


def eval_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """Turn `StepOutput.counts` summed over an evaluation set into metrics.

    Every average is over tokens (or sentence pairs), not over batches:

    - `<part>_loss` = Σ `<part>_nll` / Σ total, for part mlm (total `mlm_total`, masked
      tokens), lm (`lm_tokens`, predicted next tokens), span (`span_tokens`, target tokens),
      nsp / sop (`pair_total`, pairs).
    - `<part>_accuracy` = Σ `<part>_correct` / Σ total: argmax equals the label.
    - `perplexity` = exp(token loss), the mlm, lm or span loss (inf past exp's range).
    - `loss` = the sum of the part losses, as in training (BERT: mlm_loss + nsp_loss).

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
    token_losses = [
        metrics[f"{name}_loss"] for name, _ in _TOKEN_LOSSES if f"{name}_loss" in metrics
    ]
    if token_losses:
        metrics["perplexity"] = math.exp(token_losses[0]) if token_losses[0] < 700 else math.inf
    losses = [value for key, value in metrics.items() if key.endswith("_loss")]
    if losses:
        metrics["loss"] = sum(losses)
    return metrics


def _body_parameters(module: nn.Module, output: Tensor) -> int:
    """Parameters of `module` except embedding tables and the vocabulary projection."""
    skip = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    skip.add(id(output))
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)


def flops_per_token(
    model_config: tf.PreTrainedConfig,
    seq_len: int,
    objective: str,
    *,
    mlm_probability: float = 0.15,
    sparse_mlm: bool = True,
    target_len: int | None = None,
) -> float:
    """Training FLOPs (forward + backward) per input token, for MFU (docs/models.md).

    PaLM appendix B / Megatron convention: 6·N + 12·L·A·T, where N counts the non-embedding
    parameters, L layers, A = heads * head width and T = `seq_len`, with the causal mask not
    halving the attention term. The vocabulary projection (6·d·V per predicted token) is
    counted apart: at `mlm_probability` of the positions for sparse MLM, at all of them
    otherwise. T5 counts per encoder token: the decoder runs `target_len / seq_len` tokens per
    encoder token, with self-attention over `target_len` and cross-attention over `seq_len`.

    Raises:
        ValueError: span_corruption without `target_len`.
    """
    family = family_of(model_config)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = model_class(family)(copy.deepcopy(model_config))
    projection = model.get_submodule(_OUTPUT_LAYER[family])
    assert isinstance(projection, nn.Linear)
    output = projection.weight  # (V, d)
    head = 6.0 * output.numel()
    width = float(model_config.num_attention_heads * _head_dim(model_config))
    if objective != "span_corruption":
        predicted = mlm_probability if objective in MLM_OBJECTIVES and sparse_mlm else 1.0
        attention = 12.0 * int(model_config.num_hidden_layers) * width * seq_len
        return 6.0 * _body_parameters(model, output) + attention + head * predicted
    if target_len is None:
        raise ValueError("flops_per_token for span_corruption needs target_len")
    encoder = 6.0 * _body_parameters(model.get_submodule("encoder"), output)
    encoder += 12.0 * int(model_config.num_layers) * width * seq_len
    decoder = 6.0 * _body_parameters(model.get_submodule("decoder"), output) + head
    decoder += 12.0 * int(model_config.num_decoder_layers) * width * (target_len + seq_len)
    return encoder + decoder * target_len / seq_len


def _head_dim(config: tf.PreTrainedConfig) -> int:
    """Width of one attention head (T5 `d_kv`, Llama `head_dim`, else hidden / heads)."""
    explicit = getattr(config, "head_dim", None)  # T5 maps head_dim to d_kv
    if explicit:
        return int(explicit)
    return int(config.hidden_size // config.num_attention_heads)
