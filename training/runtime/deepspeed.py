"""The DeepSpeed config, derived from `TrainConfig` (never hand-edited JSON), and param groups.

Nothing here imports DeepSpeed: the dict is plain data, logged with the run and stored in every
checkpoint's `meta.json` and in the registry's lineage tags.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from training.pretrain.config import TrainConfig

# torch.optim.AdamW in DeepSpeed's wrapper: FusedAdam needs CUDA and DeepSpeedCPUAdam a JIT
# compile; torch's own fused AdamW runs on CPU and GPU and is identical across hosts.
_NORM_OR_BIAS = ("bias", "norm", "layernorm", "layer_norm", "ln_")


def deepspeed_config(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config for `cfg` on `world_size` data-parallel ranks.

    `cfg.deepspeed_extra` is merged last (nested dicts merge key by key), so a user can set
    any DeepSpeed key the typed config does not cover.
    """
    accum = cfg.accumulation_steps(world_size)
    opt = cfg.optim
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.zero_stage == 3:
        # Export gathers fp32 weights from the shards (zero_to_fp32); no 16-bit copy on save.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    ds: dict[str, Any] = {
        "train_batch_size": cfg.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch(world_size),
        "gradient_accumulation_steps": accum,
        "gradient_clipping": opt.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": {"enabled": cfg.precision == "fp16", "initial_scale_power": 16},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": opt.lr,
                "betas": list(opt.betas),
                "eps": opt.eps,
                "weight_decay": opt.weight_decay,
                "torch_adam": True,
                "adam_w_mode": True,
                # torch's fused CPU/GPU AdamW: one kernel over all tensors (measured 8x faster
                # than the per-tensor loop on CPU, docs/benchmarks.md); same update rule.
                "fused": True,
            },
        },
        # No "scheduler": the loop sets every group's rate (training/runtime/schedule.py), so the
        # first step already trains (DeepSpeed's WarmupDecayLR gave it lr 0).
        "steps_per_print": 1 << 30,  # lmpipe logs; DeepSpeed's own prints would interleave
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronises the device at the start of
        # every forward and at every step from the third on; lmpipe measures its own throughput.
        "timers": {"throughput": {"enabled": False}},
    }
    if cfg.zero_stage > 0:
        ds["zero_allow_untested_optimizer"] = True
    elif cfg.precision != "fp16":  # fp16 keeps DeepSpeed's loss scaler, which clips unscaled
        # ZeRO 0 steps torch's fused AdamW directly, and nothing in the step reads a value on
        # the host: the loop clips (the norm stays a tensor) and bf16 is torch's autocast over
        # fp32 weights. DeepSpeed's own bf16 mode wraps the optimizer in one that checks every
        # gradient for overflow on the host (about 70 reads a step, docs/pretraining.md).
        ds["gradient_clipping"] = 0.0
        if cfg.precision == "bf16":
            ds["bf16"] = {"enabled": False}
            ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return merge(ds, cfg.deepspeed_extra)


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
