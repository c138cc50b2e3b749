"""The optimizer engine a training loop steps: DeepSpeed, or plain PyTorch (DDP) without it.

Pretraining always runs on DeepSpeed; fine-tuning may (`finetune.deepspeed`). Both loops drive
the same small surface (`forward`, `backward`, `step`, `module`, `optimizer`), so the loop code
is written once. This is the only module that calls `deepspeed.initialize`. Also here:
`FusedUpdate`, the update the pretraining loop makes itself at ZeRO 0 on one rank.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import optimizer as torch_optimizer


class Engine(Protocol):
    """What a loop needs from its engine."""

    module: torch.nn.Module
    optimizer: Any
    device: torch.device

    def __call__(self, **batch: torch.Tensor) -> Any: ...  # noqa: D102
    def backward(self, loss: torch.Tensor) -> None: ...  # noqa: D102
    def step(self) -> None: ...  # noqa: D102
    def is_gradient_accumulation_boundary(self) -> bool: ...  # noqa: D102
    def get_global_grad_norm(self) -> float | None: ...  # noqa: D102


def initialize_deepspeed(
    model: torch.nn.Module,
    groups: list[dict[str, Any]],
    config: dict[str, Any],
    zero3_leaves: list[type[torch.nn.Module]] | None = None,
) -> Any:
    """A DeepSpeed engine over `model` with the optimizer `config` describes on `groups`.

    `zero3_leaves`: module classes ZeRO-3 gathers whole instead of hooking their children
    (a mixture of experts' sparse blocks, `training.pretrain.pretraining_model.zero3_leaf_modules`).
    """
    deepspeed = import_deepspeed()
    skip_cpu_shm_op()
    if zero3_leaves:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, zero3_leaves)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    drop_idle_forward_hooks(engine)
    return engine


def drop_idle_forward_hooks(engine: Any) -> None:
    """Remove the forward hooks DeepSpeed puts on `engine.module` where they would do nothing.

    The engine hooks a prologue and an epilogue around every forward of its module, which
    lmpipe's loops call directly (for their losses). Both only serve features of DeepSpeed's
    own: ZeRO-3's gathering of partitioned weights, fp16 input casting, the FLOPs profiler,
    the throughput timer, the wall-clock breakdown, random layer-token drop, autotuning and
    the memory breakdown. With none of them on, the hooks are a dozen config lookups per
    forward, and the hooked call takes `Module.__call__`'s slow path: 0.06 ms of a 31 ms step
    at nanoGPT's shape on a 2-core CPU (two workers interleaved, with and without them).
    """
    needed = (
        engine.zero_optimization_partition_weights()
        or engine.fp16_auto_cast()
        or engine.flops_profiler_enabled()
        or engine.wall_clock_breakdown()
        or engine.random_ltd_enabled()
        or engine.autotuning_profile_model_info()
        or engine.memory_breakdown()
        or engine.tput_timer.config.enabled
    )
    if needed:
        return
    for name in ("module_forward_pre_hook", "module_forward_post_hook"):
        handle = getattr(engine, name, None)
        if handle is not None:
            handle.remove()
            setattr(engine, name, None)


def import_deepspeed() -> ModuleType:
    """`import deepspeed`, without the import of MLflow that DeepSpeed's autotuner tries.

    DeepSpeed's runtime config imports `deepspeed.autotuning`, whose autotuner does
    `import mlflow` and carries on without it: 1.2-1.8 s of every worker's start, for a tool
    (`deepspeed --autotuning`) that lmpipe never runs. While DeepSpeed is first imported, a
    process that has not imported MLflow yet has the import refused (`None` in `sys.modules`,
    Python's documented way), so DeepSpeed is loaded without it; MLflow stays importable
    afterwards, for the tracker of rank 0 as for anything else.
    """
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return importlib.import_module("deepspeed")
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        return importlib.import_module("deepspeed")
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]


def skip_cpu_shm_op() -> None:
    """On DeepSpeed's CPU accelerator, create its communication backend without the shm op.

    That op (`deepspeed_shm_comm`) serves only `inference_all_reduce`, which no training
    step calls, yet the backend JIT-compiles it the first time each environment starts
    DeepSpeed: 60-80 s of C++ on a 2-core machine, paid by the first training run of every
    fresh install and by each worker that finds the build cache from another environment.
    Without it the backend's all-reduce is the process group's own (gloo), as training uses.
    Must run before the first `deepspeed.initialize` of the process, which creates the backend.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        # By name: the attribute `deepspeed.comm.torch` is the torch package itself.
        backend = importlib.import_module("deepspeed.comm.torch")
        backend.build_shm_op = _no_shm_op  # type: ignore[attr-defined]


def _no_shm_op() -> None:
    """`deepspeed.comm.torch.build_shm_op` for training: no op (the backend then uses gloo)."""
    return None


@contextlib.contextmanager
def autocast_for(ds_config: dict[str, Any], device: torch.device) -> Iterator[None]:
    """Autocast to the config's `torch_autocast` dtype, if enabled (else nothing).

    The loop calls the model itself (for its losses), not `engine(...)`, so it enters the
    autocast that DeepSpeed's own forward would have.
    """
    section = ds_config.get("torch_autocast", {})
    if not section.get("enabled"):
        yield
        return
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[section["dtype"]]
    with torch.autocast(device.type, dtype=dtype):
        yield


def base_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under DeepSpeed's wrappers (ZeRO, fp16), which steps the weights."""
    while not type(optimizer).__module__.startswith("torch.optim") and hasattr(
        optimizer, "optimizer"
    ):
        optimizer = optimizer.optimizer
    return optimizer


def fused_optimizer(engine: Any) -> Any:
    """The torch AdamW under `engine` that steps the weights, checked to be the fused one.

    The pretraining step skips an update on the device through it: the guard's flag is set as
    its `found_inf` (the attribute `torch.amp.GradScaler` sets), and at 1 the fused kernel
    leaves every weight and its own state (moments, step count) exactly as they were.

    Raises:
        ValueError: the engine steps another optimizer (one from `train.deepspeed_extra`).
    """
    optimizer = base_optimizer(engine.optimizer)
    if not getattr(optimizer, "defaults", {}).get("fused"):
        raise ValueError(
            "train.guard skips a step on the device through torch's fused AdamW (lmpipe's "
            f"DeepSpeed optimizer); this engine steps {type(optimizer).__name__}: "
            "remove the optimizer from train.deepspeed_extra"
        )
    return optimizer


class TorchEngine:
    """AdamW over `groups`, DDP when a process group is up, gradient accumulation and clipping.

    Mirrors the DeepSpeed engine's contract: `backward` scales the loss by 1/accumulation and
    `step` only updates the weights on an accumulation boundary.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: list[dict[str, Any]],
        *,
        betas: tuple[float, float],
        eps: float,
        accumulation_steps: int,
        grad_clip: float,
    ) -> None:
        """Wrap `model` (in DDP when distributed) and build AdamW over `groups`."""
        self.module = model
        self.device = next(model.parameters()).device
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        # find_unused_parameters: frozen strategies and progressive unfreezing leave params
        # without gradients in some steps.
        self._forward: torch.nn.Module = (
            DistributedDataParallel(model, find_unused_parameters=True) if distributed else model
        )
        # fused: one kernel over every tensor, on CPU as on GPU (docs/benchmarks.md).
        self.optimizer = torch.optim.AdamW(groups, betas=betas, eps=eps, fused=True)
        self.accumulation_steps = accumulation_steps
        self.grad_clip = grad_clip
        self.micro_steps = 0
        self._grad_norm: float | None = None

    def __call__(self, **batch: torch.Tensor) -> Any:
        """Forward through the (DDP-wrapped) model."""
        return self._forward(**batch)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step` updates the weights."""
        return (self.micro_steps + 1) % self.accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss / accumulation_steps`."""
        (loss / self.accumulation_steps).backward()  # type: ignore[no-untyped-call]

    def step(self) -> None:
        """On an accumulation boundary: clip, update, zero the gradients."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.grad_clip > 0:
            self._grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm before clipping at the last update (None without clipping)."""
        return self._grad_norm


# -- the direct step's update: clip, fused AdamW, zero the gradients, as one call --------

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
    """Clip `params`' gradients at `clip`, step `optimizer` (a fused torch AdamW), zero them.

    What the pretraining loop calls where it updates the weights itself (one rank, ZeRO 0:
    `StepParts.direct`). It gives, bit for bit, what `clip_grad_norm_(params, clip,
    foreach=True)`, `optimizer.step()` and `optimizer.zero_grad(set_to_none=True)` give: the
    same kernels (`_foreach_norm`, one stack and norm, `_foreach_mul_`, `_fused_adamw_` per
    group with the optimizer's `found_inf`) on the same tensors, in the same order, and the
    same step counts (1 added, `found_inf` taken off, in one call each for all groups). It
    leaves out the Python around them, which a small model pays at every step: the step
    wrapper (profiler range, hook loops), `_init_group`'s walk over every state, the grouping
    of tensors by device and dtype, `zero_grad`'s profiler range. The tensor lists are built
    once and rebuilt when the optimizer's state or groups are replaced (a loaded checkpoint
    replaces both). Any call it does not cover takes the stock calls: a parameter without a
    gradient, a state not yet created (the first step creates it), a hook on the optimizer,
    an optimizer that is not a plain fused AdamW on one device and dtype. DeepSpeed's own
    step (ZeRO, several ranks) clips and steps in the engine instead.
    """

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
