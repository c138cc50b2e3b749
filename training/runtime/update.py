"""One optimizer update of the direct step: clip, fused AdamW, zero the gradients, as one call.

`FusedUpdate` is what the pretraining loop calls where it updates the weights itself (one rank,
ZeRO 0: `StepParts.direct`). It gives, bit for bit, what
`clip_grad_norm_(params, clip, foreach=True)`, `optimizer.step()` and
`optimizer.zero_grad(set_to_none=True)` give: the same kernels (`_foreach_norm`, one stack and
norm, `_foreach_mul_`, `_fused_adamw_` per group with the optimizer's `found_inf`) on the same
tensors, in the same order, and the same step counts (1 added, `found_inf` taken off, in one
call each for all groups). What it leaves out is the Python around them, which a small model
pays at every step: the optimizer's step wrapper (profiler range, hook loops),
`_init_group`'s walk over every parameter and its state, the grouping of tensors by device
and dtype (done twice in the clip, once per group in the step), and `zero_grad`'s profiler
range. The tensor lists are built once and rebuilt when the optimizer's state or groups are
replaced (a loaded checkpoint replaces both).

Any call it does not cover takes the stock calls: a parameter without a gradient (frozen for
the step), a state not yet created (the first step creates it), a hook on the optimizer, or an
optimizer that is not a plain fused AdamW on one device and dtype.
Not here: DeepSpeed's own step (ZeRO, several ranks), which clips and steps in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import optimizer as torch_optimizer

#: What every group must hold for the fused kernel to stand in for `AdamW.step`.
_PLAIN = {"fused": True, "amsgrad": False, "maximize": False, "capturable": False}
_PLAIN |= {"differentiable": False, "decoupled_weight_decay": True}


@dataclass(frozen=True)
class _Group:
    """One parameter group's tensor lists, in the group's order (what `_init_group` lists)."""

    options: dict[str, Any]  # the group itself: its `lr` changes every step, read at the call
    params: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    steps: list[Tensor]


@dataclass(frozen=True)
class _Plan:
    """The lists of one optimizer state, and what they were built from."""

    state: Any
    param_groups: list[dict[str, Any]]
    groups: list[_Group]
    steps: list[Tensor]  # every group's step counts, in order


class FusedUpdate:
    """Clip `params`' gradients at `clip`, step `optimizer` (a fused torch AdamW), zero them."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Tensor], clip: float) -> None:
        """Update with `optimizer`; clip (when `clip` > 0) the norm over `params`, in order.

        `params` are the parameters the optimizer steps, in the order the norm sums them.
        """
        self.optimizer, self.params, self.clip = optimizer, params, clip
        self._plan: _Plan | None = None

    @torch.no_grad()
    def __call__(self) -> Tensor | None:
        """Make the update; return the gradient norm before clipping (None without a clip)."""
        grads = [p.grad for p in self.params]
        plan = self._current_plan() if all(g is not None for g in grads) else None
        if plan is None:
            return self._stock()
        norm = None
        if self.clip > 0:
            norm = _clip(grads, self.clip)  # type: ignore[arg-type]  # checked: none is None
        found_inf = getattr(self.optimizer, "found_inf", None)
        # As the stock step: 1 added to every step count before the kernels, `found_inf` taken
        # off after them (a skipped update leaves them as they were), here in one call each for
        # all groups. Not one add of 1 - found_inf: with a tensor scalar, a CPU foreach add
        # reads it on the host.
        torch._foreach_add_(plan.steps, 1)
        for group in plan.groups:
            options = group.options
            beta1, beta2 = options["betas"]
            torch._fused_adamw_(
                group.params,
                [p.grad for p in group.params],  # type: ignore[misc]  # checked: none is None
                group.exp_avgs,
                group.exp_avg_sqs,
                [],
                group.steps,
                amsgrad=False,
                lr=options["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=options["weight_decay"],
                eps=options["eps"],
                maximize=False,
                grad_scale=None,
                found_inf=found_inf,
            )
        if found_inf is not None:
            torch._foreach_sub_(plan.steps, [found_inf] * len(plan.steps))
        for p in self.params:
            p.grad = None
        return norm

    def _stock(self) -> Tensor | None:
        """The stock calls, for an update the fused path does not cover."""
        norm = None
        if self.clip > 0:
            with_grad = [p for p in self.params if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(with_grad, self.clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _current_plan(self) -> _Plan | None:
        """The tensor lists for this step, rebuilt if the state or groups were replaced."""
        optimizer = self.optimizer
        if (
            optimizer._optimizer_step_pre_hooks
            or optimizer._optimizer_step_post_hooks
            or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks
            or getattr(optimizer, "grad_scale", None) is not None
        ):
            return None
        plan = self._plan
        if (
            plan is None
            or plan.state is not optimizer.state
            or plan.param_groups is not optimizer.param_groups
            or len(plan.groups) != len(optimizer.param_groups)
        ):
            plan = self._plan = _build_plan(optimizer, self.params)
        return plan


def _build_plan(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> _Plan | None:
    """The lists of every group, or None where the fused path cannot stand in for `step`.

    It stands in for a plain fused AdamW whose groups step exactly `params` (every one with
    its state created), all of one device and dtype.
    """
    if not isinstance(optimizer, torch.optim.AdamW):
        return None
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    if len(stepped) != len(params) or {id(p) for p in stepped} != {id(p) for p in params}:
        return None
    if len({(p.device, p.dtype) for p in stepped}) > 1:
        return None
    groups = []
    for options in optimizer.param_groups:
        if any(options.get(key) != value for key, value in _PLAIN.items()):
            return None
        states = [optimizer.state.get(p) for p in options["params"]]
        if any(not state for state in states):  # the stock step creates it
            return None
        groups.append(
            _Group(
                options,
                list(options["params"]),
                [s["exp_avg"] for s in states],  # type: ignore[index]
                [s["exp_avg_sq"] for s in states],  # type: ignore[index]
                [s["step"] for s in states],  # type: ignore[index]
            )
        )
    steps = [step for group in groups for step in group.steps]
    return _Plan(optimizer.state, optimizer.param_groups, groups, steps)


def _clip(grads: list[Tensor], clip: float) -> Tensor:
    """Scale `grads` in place to a norm of at most `clip`; return their norm before.

    `clip_grad_norm_`'s operations for tensors of one device and dtype, in its order, so the
    result is the same to the bit.
    """
    norm: Tensor = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, torch.clamp(clip / (norm + 1e-6), max=1.0))
    return norm
