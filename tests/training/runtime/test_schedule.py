"""Per-group lr schedule, parameter groups, and early stopping on a scripted validation curve."""

from __future__ import annotations

import math

import pytest
import torch

from training.finetune.early_stopping import EarlyStopping, snapshot
from training.runtime.schedule import (
    GroupLRSchedule,
    ParamSpec,
    build_param_groups,
    lr_factor,
    set_stage,
    takes_weight_decay,
)


def optimizer_with(*scales: float, lr: float = 1.0) -> torch.optim.Optimizer:
    specs = [
        ParamSpec(f"layer.{i}.weight", torch.nn.Parameter(torch.zeros(2, 2)), "body", i, s)
        for i, s in enumerate(scales)
    ]
    return torch.optim.AdamW(build_param_groups(specs, lr, weight_decay=0.0))


# --- the factor --------------------------------------------------------------------------------


def test_warmup_trains_from_the_first_step() -> None:
    factors = [lr_factor(s, 4, 10, "linear", 0.0) for s in range(1, 5)]
    assert factors == [0.25, 0.5, 0.75, 1.0]


def test_linear_decay_reaches_min_lr_ratio_at_the_last_step() -> None:
    # W = 2, T = 6, m = 0.2: steps 3..6 have progress 1/4 .. 1 -> 1 - 0.8 p.
    factors = [lr_factor(s, 2, 6, "linear", 0.2) for s in range(3, 8)]
    assert factors == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.2])


def test_cosine_decay_follows_the_half_cosine() -> None:
    # W = 0, T = 4, m = 0: p = s / 4, factor = (1 + cos(pi p)) / 2.
    factors = [lr_factor(s, 0, 4, "cosine", 0.0) for s in range(1, 5)]
    expected = [(1 + math.cos(math.pi * s / 4)) / 2 for s in range(1, 5)]
    assert factors == pytest.approx(expected)
    assert factors[1] == pytest.approx(0.5)


def test_constant_decay_holds_the_peak_after_warmup() -> None:
    assert [lr_factor(s, 2, 5, "constant", 0.5) for s in range(1, 6)] == [0.5, 1, 1, 1, 1]


# --- the schedule ------------------------------------------------------------------------------


def test_schedule_sets_each_group_from_its_base_scale_and_factor() -> None:
    optimizer = optimizer_with(1.0, 0.5, 0.25, lr=2e-3)
    schedule = GroupLRSchedule(optimizer, warmup_steps=2, total_steps=4, decay="linear")
    seen = [schedule.get_last_lr()]
    for _ in range(3):
        schedule.step()
        seen.append(schedule.get_last_lr())
    factors = [0.5, 1.0, 0.5, 0.0]  # steps 1, 2 warm up; steps 3, 4 decay to 0
    expected = [[2e-3 * f * s for s in (1.0, 0.5, 0.25)] for f in factors]
    assert seen == [pytest.approx(row) for row in expected]


def test_schedule_gives_inactive_groups_lr_zero_and_activation_takes_effect_at_once() -> None:
    specs = [
        ParamSpec("head.weight", torch.nn.Parameter(torch.zeros(2, 2)), "head", 3, 1.0, 0),
        ParamSpec("layer.weight", torch.nn.Parameter(torch.zeros(2, 2)), "body", 2, 0.5, 1),
    ]
    groups = build_param_groups(specs, 1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(groups)
    schedule = GroupLRSchedule(optimizer, warmup_steps=4, total_steps=8)
    assert schedule.get_last_lr() == pytest.approx([2.5e-3, 0.0])
    schedule.step()
    assert set_stage(groups, 1) == ["body.d2"]
    assert schedule.get_last_lr() == pytest.approx([5e-3, 2.5e-3])


def test_schedule_state_dict_resumes_the_same_rates() -> None:
    first = GroupLRSchedule(optimizer_with(1.0, 0.1), warmup_steps=3, total_steps=9, decay="cosine")
    for _ in range(5):
        first.step()
    second = GroupLRSchedule(
        optimizer_with(1.0, 0.1), warmup_steps=3, total_steps=9, decay="cosine"
    )
    second.load_state_dict(first.state_dict())
    assert second.get_last_lr() == first.get_last_lr()
    assert second.steps_done == 5


def test_schedule_refuses_a_checkpoint_of_another_schedule() -> None:
    saved = GroupLRSchedule(optimizer_with(1.0), warmup_steps=3, total_steps=9).state_dict()
    other = GroupLRSchedule(optimizer_with(1.0), warmup_steps=3, total_steps=12)
    with pytest.raises(ValueError, match="total_steps=9"):
        other.load_state_dict(saved)


def test_schedule_leaves_plain_groups_at_their_own_lr() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [param], "lr": 0.3}])
    schedule = GroupLRSchedule(optimizer, warmup_steps=0, total_steps=2, decay="constant")
    assert schedule.get_last_lr() == [0.3]


@pytest.mark.parametrize(
    ("warmup", "total", "decay", "ratio"),
    [(5, 4, "linear", 0.0), (-1, 4, "linear", 0.0), (0, 4, "step", 0.0), (0, 4, "cosine", 2.0)],
)
def test_schedule_refuses_bad_settings(warmup: int, total: int, decay: str, ratio: float) -> None:
    with pytest.raises(ValueError, match=r"warmup_steps|decay|min_lr_ratio"):
        GroupLRSchedule(optimizer_with(1.0), warmup, total, decay, ratio)  # type: ignore[arg-type]


# --- parameter groups ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "shape", "decays"),
    [
        ("bert.encoder.layer.0.output.dense.weight", (4, 4), True),
        ("bert.encoder.layer.0.output.dense.bias", (4,), False),
        ("bert.encoder.layer.0.output.LayerNorm.weight", (4,), False),
        ("transformer.ln_f.weight", (4,), False),
        ("model.norm.weight", (4,), False),
        ("prompt_encoder.default.embedding.weight", (3, 4), True),
    ],
)
def test_weight_decay_skips_biases_norms_and_vectors(
    name: str, shape: tuple[int, ...], decays: bool
) -> None:
    assert takes_weight_decay(name, torch.zeros(shape)) is decays


def test_build_param_groups_refuses_a_parameter_twice() -> None:
    param = torch.nn.Parameter(torch.zeros(2, 2))
    specs = [ParamSpec("a", param, "body", None, 1.0), ParamSpec("b", param, "body", None, 1.0)]
    with pytest.raises(ValueError, match="listed twice"):
        build_param_groups(specs, 1e-3, 0.0)


# --- early stopping --------------------------------------------------------------------------

CURVE = [0.5, 0.6, 0.7, 0.65, 0.68, 0.66, 0.9]  # the last value comes after any stop


def run_curve(
    stopper: EarlyStopping, model: torch.nn.Linear
) -> tuple[int, dict[int, torch.Tensor]]:
    """Feed CURVE epoch by epoch, the weights set to the epoch number; return the stop epoch."""
    weights = {}
    for epoch, value in enumerate(CURVE):
        with torch.no_grad():
            model.weight.fill_(float(epoch))
        weights[epoch] = model.weight.detach().clone()
        if stopper.update(epoch, value, model).stop:
            return epoch, weights
    return len(CURVE), weights


@pytest.mark.parametrize(("patience", "stop_epoch"), [(2, 4), (3, 5)])
def test_early_stopping_stops_at_the_expected_epoch_and_restores_the_best(
    patience: int, stop_epoch: int
) -> None:
    model = torch.nn.Linear(3, 2)
    stopper = EarlyStopping("accuracy", higher_is_better=True, patience=patience)
    stopped, weights = run_curve(stopper, model)

    assert (stopped, stopper.best_epoch, stopper.best_value) == (stop_epoch, 2, 0.7)
    assert stopper.restore(model)
    assert torch.equal(model.weight, weights[2])


def test_early_stopping_needs_more_than_min_delta_and_minds_the_direction() -> None:
    stopper = EarlyStopping("loss", higher_is_better=False, patience=2, min_delta=0.05)
    decisions = [stopper.update(e, v) for e, v in enumerate([1.0, 0.97, 0.9, 0.88, 0.87])]
    assert [d.improved for d in decisions] == [True, False, True, False, False]
    assert [d.stop for d in decisions] == [False, False, False, False, True]
    assert stopper.best_epoch == 2


def test_early_stopping_never_counts_nan_as_best() -> None:
    stopper = EarlyStopping("f1", patience=1)
    assert not stopper.update(0, float("nan")).improved
    assert not stopper.restore(torch.nn.Linear(2, 2))  # nothing to restore


def test_early_stopping_snapshots_only_trainable_weights() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    assert set(snapshot(model)) == {"1.weight", "1.bias"}  # frozen weights cannot change
    stopper = EarlyStopping("acc", patience=1)
    stopper.update(0, 0.5, model)
    best = model[1].weight.detach().clone()
    with torch.no_grad():
        model[1].weight.add_(1.0)
    stopper.update(1, 0.4, model)
    assert stopper.restore(model)
    assert torch.equal(model[1].weight, best)


def test_early_stopping_refuses_epochs_out_of_order() -> None:
    stopper = EarlyStopping("acc")
    stopper.update(3, 0.5)
    with pytest.raises(ValueError, match="epoch 3 does not follow epoch 3"):
        stopper.update(3, 0.6)


def test_early_stopping_state_dict_resumes_the_counters() -> None:
    first = EarlyStopping("acc", patience=2)
    for epoch, value in enumerate([0.5, 0.7, 0.6]):
        first.update(epoch, value)
    second = EarlyStopping("acc", patience=2)
    second.load_state_dict(first.state_dict())
    assert second.update(3, 0.65).stop
    assert second.best_epoch == 1
