"""Class weights and focal loss against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from training.finetune.task_losses import (
    balanced_class_weights,
    class_counts,
    classification_loss,
    focal_loss,
    resolve_class_weights,
    weighted_cross_entropy,
)

# Two examples over two classes with p = (1/4, 3/4) each: logits (0, ln 3).
LOGITS = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
LABELS = torch.tensor([1, 0])  # true-class probabilities 3/4 and 1/4
NLL = (-math.log(0.75), -math.log(0.25))  # 0.2877, 1.3863


def test_class_counts_skip_ignored_positions() -> None:
    labels = np.array([[0, 2, -100], [2, 2, -100]])
    assert class_counts(labels, num_labels=3).tolist() == [1, 0, 3]


def test_class_counts_name_a_label_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"label 3 is outside \[0, 3\)"):
        class_counts([0, 1, 3], num_labels=3)


def test_balanced_weights_are_n_over_k_times_count() -> None:
    # N = 10, K = 3: w = 10 / (3 * (6, 3, 1)).
    weights = balanced_class_weights([6, 3, 1])
    assert weights.tolist() == pytest.approx([10 / 18, 10 / 9, 10 / 3])
    assert float((weights * torch.tensor([6.0, 3.0, 1.0])).sum()) == pytest.approx(10.0)


def test_balanced_weights_refuse_a_class_that_never_occurs() -> None:
    with pytest.raises(ValueError, match=r"classes \[1\] never occur"):
        balanced_class_weights([4, 0, 2])


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("none", None), ("balanced", [0.75, 1.5]), ([1.0, 4.0], [1.0, 4.0])],
)
def test_resolve_class_weights_reads_each_setting(
    spec: str | list[float], expected: list[float] | None
) -> None:
    weights = resolve_class_weights(spec, counts=[4, 2], num_labels=2)
    assert (weights if weights is None else weights.tolist()) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [([1.0], "1 values, the task has 2 labels"), ([1.0, 0.0], "> 0"), ("inverse", "must be")],
)
def test_resolve_class_weights_refuses_bad_settings(spec: str | list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_class_weights(spec, counts=[4, 2], num_labels=2)


def test_weighted_cross_entropy_matches_the_hand_value() -> None:
    weights = torch.tensor([2.0, 1.0])
    expected = (1.0 * NLL[0] + 2.0 * NLL[1]) / 3.0  # 1.0200903
    loss = weighted_cross_entropy(LOGITS, LABELS, weights)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(loss) == pytest.approx(1.0200903, rel=1e-6)


def test_focal_loss_matches_the_hand_value() -> None:
    # gamma 2: (1 - 3/4)^2 * 0.2877 = 0.01798 and (1 - 1/4)^2 * 1.3863 = 0.77979.
    terms = (0.25**2 * NLL[0], 0.75**2 * NLL[1])
    assert float(focal_loss(LOGITS, LABELS, gamma=2.0)) == pytest.approx(sum(terms) / 2, rel=1e-6)
    alpha = torch.tensor([2.0, 1.0])
    weighted = (1.0 * terms[0] + 2.0 * terms[1]) / 3.0  # 0.525853
    assert float(focal_loss(LOGITS, LABELS, 2.0, alpha)) == pytest.approx(weighted, rel=1e-6)
    assert weighted == pytest.approx(0.525853, rel=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_focal_loss_with_gamma_zero_equals_cross_entropy(weighted: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, 5, generator=gen)
    labels = torch.randint(0, 5, (4, 7), generator=gen)
    labels[:, :2] = -100
    weights = torch.rand(5, generator=gen) + 0.5 if weighted else None
    reference = F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1), weight=weights)
    assert torch.allclose(focal_loss(logits, labels, gamma=0.0, alpha=weights), reference)
    assert torch.allclose(weighted_cross_entropy(logits, labels, weights), reference)


def test_losses_ignore_positions_labelled_minus_100() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 3, generator=gen)
    labels = torch.randint(0, 3, (2, 6), generator=gen)
    labels[0, 4:] = -100
    kept = labels != -100
    for loss_fn in (weighted_cross_entropy, focal_loss):
        full = loss_fn(logits, labels)
        only_kept = loss_fn(logits[kept], labels[kept])
        assert torch.allclose(full, only_kept)


def test_nothing_labelled_gives_zero_loss_that_still_backpropagates() -> None:
    logits = torch.randn(3, 4, requires_grad=True)
    labels = torch.full((3,), -100)
    for focal_gamma in (None, 2.0):
        loss = classification_loss(logits, labels, focal_gamma=focal_gamma)
        loss.backward()
        assert float(loss.detach()) == 0.0
        assert logits.grad is not None
        assert torch.count_nonzero(logits.grad) == 0


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_focal_loss_gradient_stays_finite_for_saturated_logits(gamma: float) -> None:
    logits = torch.tensor([[0.0, 100.0], [0.0, 1.0]], requires_grad=True)  # p = 1.0 exactly
    focal_loss(logits, torch.tensor([1, 0]), gamma=gamma).backward()
    assert logits.grad is not None
    assert bool(torch.isfinite(logits.grad).all())


def test_focal_loss_down_weights_easy_examples() -> None:
    # Relative to cross entropy, the confident (easy) example loses most of its weight.
    easy, hard = focal_loss(LOGITS[:1], LABELS[:1]), focal_loss(LOGITS[1:], LABELS[1:])
    assert float(easy) / NLL[0] == pytest.approx(0.25**2)
    assert float(hard) / NLL[1] == pytest.approx(0.75**2)


def test_classification_loss_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"logits \(2, 3\) need labels of shape \(2,\)"):
        classification_loss(torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.long))
