"""What both training loops give DeepSpeed: the optimizer entry, merged extras, param groups.

Each loop derives its whole DeepSpeed dict from its own section (`deepspeed_config` in
`training/pretrain/config.py`, fine-tuning's engine in `training/finetune/loop.py`), never
hand-edited JSON. Nothing here imports DeepSpeed or torch: the dict is plain data, logged with
the run and stored in every checkpoint's `meta.json` and in the registry's lineage tags.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch.optim.AdamW in DeepSpeed's wrapper: FusedAdam needs CUDA and DeepSpeedCPUAdam a JIT
# compile; torch's own fused AdamW runs on CPU and GPU and is identical across hosts.
_NORM_OR_BIAS = ("bias", "norm", "layernorm", "layer_norm", "ln_")


def engine_config(
    *,
    global_batch: int,
    micro_batch: int,
    accumulation: int,
    grad_clip: float,
    zero_stage: int,
    precision: str,
    optimizer: dict[str, Any],
) -> dict[str, Any]:
    """What both loops' DeepSpeed dicts hold: the batch's shape, clipping, ZeRO, bf16, AdamW.

    DeepSpeed's own progress prints are off (lmpipe logs; they would interleave). Each loop adds
    what is its own (pretraining: fp16 loss scaling, the timers, the ZeRO-0 direct step).
    """
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": optimizer,
        "steps_per_print": 1 << 30,
    }


def adamw_section(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> dict[str, Any]:
    """DeepSpeed's `optimizer` entry: torch's fused AdamW (pretraining and fine-tuning alike)."""
    return {
        "type": "AdamW",
        "params": {
            "lr": lr,
            "betas": list(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "torch_adam": True,
            "adam_w_mode": True,
            # torch's fused CPU/GPU AdamW: one kernel over all tensors (measured 8x faster than
            # the per-tensor loop on CPU, docs/benchmarks.md); same update rule.
            "fused": True,
        },
    }


def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged over it, recursively for nested dicts; neither is modified."""
    out = copy.deepcopy(dict(base))
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def param_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """Two AdamW groups: decay for weight matrices, none for biases, norms and 1-D params."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in named:
        if not param.requires_grad:
            continue
        lowered = name.lower()
        skip = param.ndim < 2 or any(part in lowered for part in _NORM_OR_BIAS)
        (no_decay if skip else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
