"""Classification losses for imbalanced labels: class-weighted cross entropy and focal loss.

All losses take logits (..., C) and integer labels (...) of the same leading shape (sequence
classification (B, C)/(B,), token classification (B, T, C)/(B, T)); positions labelled
`ignore_index` (-100, the transformers convention) count nowhere. Formulas and a worked example:
docs/strategies.md ("Task losses"). Not here: regression and generation losses (the models' own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
ClassWeights = Literal["none", "balanced"] | Sequence[float]


def class_counts(
    labels: torch.Tensor | np.ndarray | Sequence[int], num_labels: int, ignore_index: int = -100
) -> torch.Tensor:
    """How often each of `num_labels` classes occurs in `labels` (ignored positions skipped).

    Raises:
        ValueError: a label outside [0, num_labels) that is not `ignore_index`.
    """
    flat = torch.as_tensor(np.asarray(labels), dtype=torch.long).reshape(-1)
    flat = flat[flat != ignore_index]
    bad = flat[(flat < 0) | (flat >= num_labels)]
    if bad.numel():
        raise ValueError(f"label {int(bad[0])} is outside [0, {num_labels})")
    return torch.bincount(flat, minlength=num_labels)


def balanced_class_weights(counts: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Inverse-frequency weights w_c = N / (K * n_c), normalised so sum_c n_c * w_c = N.

    N is the number of labelled examples and K the number of classes, so the average weight
    over the training labels is 1 and the loss keeps its scale (scikit-learn's "balanced").

    Raises:
        ValueError: a class never occurs (its weight would be infinite), naming its index.
    """
    n = torch.as_tensor(counts, dtype=torch.float64)
    if n.ndim != 1 or not n.numel():
        raise ValueError(f"counts must be a non-empty 1-D sequence, got shape {tuple(n.shape)}")
    missing = (n <= 0).nonzero().flatten().tolist()
    if missing:
        raise ValueError(
            f"classes {missing} never occur in the training labels: balanced weights would be "
            "infinite; give class_weights explicitly"
        )
    return (n.sum() / (n.numel() * n)).float()


def resolve_class_weights(
    spec: ClassWeights, counts: torch.Tensor | Sequence[int] | None, num_labels: int
) -> torch.Tensor | None:
    """The weight tensor for a `class_weights` setting: none, balanced, or one per label.

    Raises:
        ValueError: balanced without counts, or a list of the wrong length or sign.
    """
    if isinstance(spec, str):
        if spec == "none":
            return None
        if spec != "balanced":
            raise ValueError(f"class_weights must be none, balanced or a list, got {spec!r}")
        if counts is None:
            raise ValueError("class_weights: balanced needs the training label counts")
        return balanced_class_weights(counts)
    weights = torch.tensor([float(w) for w in spec])
    if weights.numel() != num_labels:
        raise ValueError(
            f"class_weights has {weights.numel()} values, the task has {num_labels} labels"
        )
    if not bool(torch.all(weights > 0)):
        raise ValueError(f"class_weights must all be > 0, got {list(spec)}")
    return weights


def _flatten(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} need labels of shape {tuple(logits.shape[:-1])}, "
            f"got {tuple(labels.shape)}"
        )
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


def _weighted_mean(per_example: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # No data-dependent branch (no host sync): with nothing labelled the sum is 0 and the
    # clamped denominator keeps it 0 instead of NaN.
    return (weight * per_example).sum() / weight.sum().clamp_min(torch.finfo(weight.dtype).tiny)


def _example_weights(
    labels: torch.Tensor, weights: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels with ignored positions set to class 0, each position's weight; 0 if ignored)."""
    keep = labels != ignore_index  # (N,)
    targets = torch.where(keep, labels, torch.zeros_like(labels))
    per = torch.ones(labels.shape, device=labels.device) if weights is None else weights[targets]
    return targets, per.float() * keep


def weighted_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Cross entropy, class-weighted: sum_i w_{y_i} * -log p_i(y_i) / sum_i w_{y_i}.

    The same reduction as `torch.nn.functional.cross_entropy(weight=...)`, except that a batch
    with no labelled position gives 0 rather than NaN.
    """
    flat_logits, flat_labels = _flatten(logits, labels)
    if weights is not None:
        weights = weights.to(logits.device).float()
    targets, weight = _example_weights(flat_labels, weights, ignore_index)
    nll = F.cross_entropy(flat_logits.float(), targets, reduction="none")  # (N,)
    return _weighted_mean(nll, weight).to(logits.dtype)


def focal_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    gamma: float = 2.0,
    alpha: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Focal loss (Lin et al. 2017): sum_i a_i (1 - p_i)^gamma * -log p_i / sum_i a_i.

    p_i is the predicted probability of example i's true class and a_i = alpha[y_i] (1 without
    `alpha`). Normalised like `weighted_cross_entropy`, so gamma 0 is exactly the (weighted)
    cross entropy.
    """
    if gamma < 0:
        raise ValueError(f"focal gamma must be >= 0, got {gamma}")
    flat_logits, flat_labels = _flatten(logits, labels)
    if alpha is not None:
        alpha = alpha.to(logits.device).float()
    targets, weight = _example_weights(flat_labels, alpha, ignore_index)
    log_p = F.log_softmax(flat_logits.float(), dim=-1)  # (N, C), fp32 also for bf16 logits
    log_pt = log_p.gather(1, targets.unsqueeze(1)).squeeze(1)  # (N,)
    # (N,). The floor keeps the gradient finite where p rounds to exactly 1 (gamma < 1 would
    # give 0^(gamma - 1) = inf there); gamma 0 still gives exactly 1.
    focus = (1.0 - log_pt.exp()).clamp_min(1e-12).pow(gamma)
    return _weighted_mean(focus * -log_pt, weight).to(logits.dtype)


def classification_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    focal_gamma: float | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Cross entropy (`focal_gamma` None) or focal loss, with `weights` per class either way."""
    if focal_gamma is None:
        return weighted_cross_entropy(logits, labels, weights, ignore_index)
    return focal_loss(logits, labels, focal_gamma, weights, ignore_index)
