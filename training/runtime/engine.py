"""The optimizer engine a training loop steps: DeepSpeed, or plain PyTorch (DDP) without it.

Pretraining always runs on DeepSpeed; fine-tuning may (`finetune.deepspeed`). Both loops drive
the same small surface (`forward`, `backward`, `step`, `module`, `optimizer`), so the loop code
is written once. This is the only module that calls `deepspeed.initialize`.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


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
