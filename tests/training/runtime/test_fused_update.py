"""The direct step's update: the stock clip, AdamW step and zero_grad, to the bit, in one call."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from training.runtime.engine import FusedUpdate


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def _optimizer(model: nn.Module) -> torch.optim.AdamW:
    """Two groups, as lmpipe's `param_groups`: decay on matrices, none on the rest."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, fused=True)


def _backward(model: nn.Module, step: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    (scale * nn.functional.mse_loss(model(x), y)).backward()  # type: ignore[no-untyped-call]


def _stock(model: nn.Module, optimizer: torch.optim.Optimizer, clip: float) -> torch.Tensor:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values()]


def _assert_same(
    a: nn.Module, b: nn.Module, opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer
) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)
    for s, t in zip(_state(opt_a), _state(opt_b), strict=True):
        assert torch.equal(s, t)


def _pair() -> tuple[nn.Module, torch.optim.AdamW, nn.Module, torch.optim.AdamW, FusedUpdate]:
    stock = _model()
    fused = copy.deepcopy(stock)
    opt_stock, opt_fused = _optimizer(stock), _optimizer(fused)
    return stock, opt_stock, fused, opt_fused, FusedUpdate(opt_fused, list(fused.parameters()), 1.0)


def test_fused_update_equals_clip_step_and_zero_grad_to_the_bit_with_skips() -> None:
    stock, opt_stock, fused, opt_fused, update = _pair()
    for step in range(8):
        # Large losses at some steps, so the clip scales; a skipped update at steps 3 and 6
        skip = torch.tensor(float(step % 3 == 0 and step > 0))
        opt_stock.found_inf, opt_fused.found_inf = skip, skip  # type: ignore[attr-defined]
        for model in (stock, fused):
            _backward(model, step, scale=100.0 if step % 2 else 1.0)
        want, got = _stock(stock, opt_stock, 1.0), update()
        assert got is not None
        assert torch.equal(want, got)
        _assert_same(stock, fused, opt_stock, opt_fused)
        assert all(p.grad is None for p in fused.parameters())
    assert update._plan is not None  # the fused path ran (the first step created the state)
    assert {float(s["step"]) for s in opt_fused.state.values()} == {6.0}  # 8 steps, 2 skipped


def test_fused_update_follows_a_loaded_state_and_a_changed_learning_rate() -> None:
    stock, opt_stock, fused, opt_fused, update = _pair()
    for step in range(2):
        for model in (stock, fused):
            _backward(model, step)
        _stock(stock, opt_stock, 1.0)
        update()
    # A checkpoint of the stock run loaded into both: the fused update must use the new state.
    saved_model = copy.deepcopy(stock.state_dict())
    saved_opt = copy.deepcopy(opt_stock.state_dict())
    for step in range(2, 4):
        for model in (stock, fused):
            _backward(model, step)
        _stock(stock, opt_stock, 1.0)
        update()
    for model, opt in ((stock, opt_stock), (fused, opt_fused)):
        model.load_state_dict(saved_model)
        opt.load_state_dict(copy.deepcopy(saved_opt))  # a load may keep the tensors it is given
        for group in opt.param_groups:
            group["lr"] = 3e-3
    for step in range(2, 5):
        for model in (stock, fused):
            _backward(model, step)
        _stock(stock, opt_stock, 1.0)
        update()
        _assert_same(stock, fused, opt_stock, opt_fused)
    assert update._plan is not None
    assert update._plan.state is opt_fused.state


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m, o: m[0].bias.requires_grad_(False), id="a parameter without grad"),
        pytest.param(lambda m, o: o.register_step_post_hook(lambda *a: None), id="a step hook"),
    ],
)
def test_fused_update_takes_the_stock_calls_where_it_does_not_cover_the_step(
    change: Callable[[nn.Sequential, torch.optim.Optimizer], object],
) -> None:
    stock, opt_stock, fused, opt_fused, update = _pair()
    change(stock, opt_stock)  # type: ignore[arg-type]
    change(fused, opt_fused)  # type: ignore[arg-type]
    for step in range(3):
        for model in (stock, fused):
            _backward(model, step)
        want, got = _stock(stock, opt_stock, 1.0), update()
        assert got is not None
        assert torch.equal(want, got)
        _assert_same(stock, fused, opt_stock, opt_fused)
    assert update._plan is None


def test_fused_update_without_a_clip_returns_no_norm_and_leaves_the_gradients_unscaled() -> None:
    stock, opt_stock, fused, opt_fused, _ = _pair()
    update = FusedUpdate(opt_fused, list(fused.parameters()), 0.0)
    for step in range(3):
        for model in (stock, fused):
            _backward(model, step, scale=100.0)
        opt_stock.step()
        opt_stock.zero_grad(set_to_none=True)
        assert update() is None
        _assert_same(stock, fused, opt_stock, opt_fused)
