"""What every pretraining loss shares: the batch keys, the step's output, token cross-entropy.

A batch is a dict of int64 tensors keyed by the example stage's column names (`tasks.common.schema`)
plus `attention_mask`, and for document-masked causal blocks `position_ids` and `document_ids`.
The losses themselves are `training.pretrain.losses.encoder` and `training.pretrain.losses.decoder`;
`training.pretrain.losses` picks one per objective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tasks.common import schema

ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
IGNORE_INDEX = -100  # labels of positions that are not predicted


@dataclass(frozen=True)
class StepOutput:
    """One forward pass: the loss to backpropagate and detached per-batch statistics.

    Attributes:
        loss: Scalar with grad; the sum of the objective's mean parts (BERT: MLM + NSP).
        parts: Detached per-batch means: `mlm_loss`, `nsp_loss`/`sop_loss`, `lm_loss`,
            `span_loss`.
        counts: Detached sums to add up over batches for `eval_metrics`: `<part>_nll` (summed
            negative log-likelihood, float), `<part>_correct` (hits: the label's logit is the
            largest), the totals `mlm_total`, `pair_total`, `lm_tokens`, `span_tokens`, and
            `input_tokens` (real, non-padding input tokens, for tokens/s).
    """

    loss: Tensor
    parts: dict[str, Tensor]
    counts: dict[str, Tensor]


def require(batch: Mapping[str, Tensor], *names: str) -> None:
    """Check that `batch` holds every column in `names`.

    Raises:
        KeyError: naming the missing columns and those the batch has.
    """
    missing = [name for name in names if name not in batch]
    if missing:
        raise KeyError(f"batch lacks {missing} (has {sorted(batch)})")


def token_loss(
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
        # A hit: the target's logit is the largest (a tie counts). The same count as "argmax
        # equals the target" but for exact ties, at a fraction of the cost: a CPU argmax is
        # not vectorised (15x amax over a 768 x 320 block).
        target_logit = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        correct = ((target_logit >= logits.amax(dim=-1)) & valid).sum()
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


def step_output(
    losses: dict[str, Tensor], counts: dict[str, Tensor], batch: Mapping[str, Tensor]
) -> StepOutput:
    """Sum the parts into the loss, detach them, and add the input token count."""
    parts = list(losses.values())
    loss = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
    detached = {f"{name}_loss": value.detach() for name, value in losses.items()}
    return StepOutput(loss, detached, counts | {"input_tokens": _input_tokens(batch)})
