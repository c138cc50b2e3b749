"""What the fast-path tests share: a fast model's outputs and gradients against the stock one's.

Imported by tests/training/models/fast/test_fast_{bert,gpt2}.py (pytest puts this folder on
`sys.path`, as for the other helper modules of the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor


def outputs_and_grads(
    model: torch.nn.Module, outputs: Callable[[Any], list[Tensor]]
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """`outputs(model)`, and every parameter's gradient of a fixed random weighting of them."""
    model.zero_grad(set_to_none=True)
    tensors = outputs(model)
    rng = torch.Generator().manual_seed(1)
    loss = sum((t * torch.randn(t.shape, generator=rng)).mean() for t in tensors)
    loss.backward()  # type: ignore[union-attr]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [t.detach() for t in tensors], grads


def assert_same_outputs_and_grads(
    stock: torch.nn.Module, fast: torch.nn.Module, outputs: Callable[[Any], list[Tensor]]
) -> None:
    """The fast model's outputs and gradients equal the stock model's within 1e-5 (fp32)."""
    expected, expected_grads = outputs_and_grads(stock, outputs)
    got, got_grads = outputs_and_grads(fast, outputs)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-5, msg=name)


def stock_forward_calls(
    monkeypatch: pytest.MonkeyPatch, stock: type[Any], fast: type[Any]
) -> list[str]:
    """A list that gets "stock" each time an instance of `fast` runs `stock.forward`."""
    calls: list[str] = []
    original = stock.forward

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, fast):
            calls.append("stock")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(stock, "forward", spy)
    return calls
