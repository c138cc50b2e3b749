"""Per-group learning rates: optimizer parameter groups with an lr scale, and their schedule.

A transfer strategy (`training/finetune/strategies.py`) gives every trainable parameter a role
(head, body, adapter, lora, prompt), a depth, an lr scale and the stage at which it starts training.
`build_param_groups` turns those into optimizer groups (no weight decay on biases, norms and 1-D
parameters), and `GroupLRSchedule` sets every group's learning rate at every step:

    lr = base_lr * lr_scale * active * factor(step)

`active` is 0 for a group whose stage has not started (progressive unfreezing), so its weights
cannot move, not even by AdamW's decoupled weight decay. The groups are plain dicts, so they go
to `torch.optim.AdamW` or to `deepspeed.initialize(model_parameters=...)` alike (DeepSpeed keeps
the same dicts and their extra keys). Formulas and worked tables: docs/strategies.md.
Also here: each parameter's layer depth (`layer_index`), which layer-wise decay and progressive
unfreezing are keyed on. Not here: which parameters train (`training/finetune/strategies.py`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

Decay = Literal["linear", "cosine", "constant"]
DECAYS: tuple[Decay, ...] = ("linear", "cosine", "constant")
# Substrings of parameter names that never get weight decay (as in training/runtime/deepspeed.py).
_NO_DECAY_PARTS = ("bias", "norm", "layernorm", "layer_norm", "ln_")
# Layer depth from parameter names (leftmost match wins: T5 `block.3.layer.1` is block 3).
_DECODER = re.compile(r"(?:^|\.)decoder\.(?:block|layers?)\.(\d+)\.")
_LAYER = re.compile(r"(?:^|\.)(?:block|layers|layer|h)\.(\d+)\.")
_EMBED = re.compile(r"(?:^|\.)(?:embeddings|wte|wpe|embed_tokens|embed_positions|shared)\.")
_ENCODER_TOP = re.compile(r"(?:^|\.)encoder\.final_layer_norm\.")
_TOP = re.compile(r"(?:^|\.)(?:final_layer_norm|ln_f|norm|pooler)\.")


def stack_sizes(names: Sequence[str]) -> tuple[int, int]:
    """(encoder layers, all layers) from parameter names; one stack: both are its layers.

    Raises:
        ValueError: no name has a layer index.
    """
    encoder = [int(m[1]) + 1 for n in names if not _DECODER.search(n) and (m := _LAYER.search(n))]
    decoder = [int(m[1]) + 1 for n in names if (m := _DECODER.search(n))]
    if not encoder:
        raise ValueError("no transformer layers found in the parameter names")
    return max(encoder), max(encoder) + max(decoder, default=0)


def layer_index(name: str, num_layers: int, encoder_layers: int | None = None) -> int:
    """The depth of a body parameter: embeddings 0, layer i at i + 1, top norm/pooler L.

    Encoder-decoder models (T5) stack the decoder on the encoder: encoder block i is at i + 1,
    the encoder's final norm at E, decoder block j at E + j + 1 and the decoder's final norm at
    L = E + D (the task head sits above, at L + 1; see docs/strategies.md).

    Args:
        name: A parameter name (any prefix, e.g. `bert.encoder.layer.3.output.dense.weight`).
        num_layers: L, all transformer layers (encoder plus decoder).
        encoder_layers: E for encoder-decoder models; default `num_layers`.

    Raises:
        ValueError: the name is no embedding, layer, final norm or pooler, or its layer index
            is outside the model.
    """
    enc = num_layers if encoder_layers is None else encoder_layers
    if match := _DECODER.search(name):
        depth = enc + int(match[1]) + 1
    elif match := _LAYER.search(name):
        depth = int(match[1]) + 1
    elif _EMBED.search(name):
        depth = 0
    elif _ENCODER_TOP.search(name):
        depth = enc
    elif _TOP.search(name):
        depth = num_layers
    else:
        raise ValueError(
            f"cannot place parameter {name!r} at a layer depth: it is no embedding, layer, "
            "final norm or pooler (is it part of the task head?)"
        )
    if not 0 <= depth <= num_layers:
        raise ValueError(f"parameter {name!r} is at depth {depth}, outside 0..{num_layers}")
    return depth


@dataclass(frozen=True)
class ParamSpec:
    """How one trainable parameter is optimised.

    Attributes:
        name: The parameter's name in the model the optimizer sees.
        param: The parameter itself.
        role: head, body, adapter, lora or prompt (the first part of its group's name).
        depth: Its layer depth when groups are split by depth (layer decay, progressive
            unfreezing), else None.
        lr_scale: Multiplier on the base learning rate.
        stage: Unfreezing stage at which it starts to train; 0 trains from the start.
    """

    name: str
    param: torch.nn.Parameter
    role: str
    depth: int | None
    lr_scale: float
    stage: int = 0


class HasParamGroups(Protocol):
    """A torch optimizer, or DeepSpeed's wrapper of one (`engine.optimizer`)."""

    param_groups: list[dict[str, Any]]


def takes_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Whether AdamW decays `param`: weight matrices yes; biases, norms and 1-D tensors no."""
    lowered = name.lower()
    return param.ndim >= 2 and not any(part in lowered for part in _NO_DECAY_PARTS)


def group_name(role: str, depth: int | None, decays: bool) -> str:
    """A group's name: `role`, `.d<depth>` when split by depth, `.no_decay` without decay."""
    depth_part = "" if depth is None else f".d{depth}"
    return f"{role}{depth_part}{'' if decays else '.no_decay'}"


def build_param_groups(
    specs: Iterable[ParamSpec], base_lr: float, weight_decay: float, stage: int = 0
) -> list[dict[str, Any]]:
    """Optimizer groups of `specs`, one per (role, depth, decay or not).

    Args:
        specs: Every parameter the strategy may ever train, each exactly once.
        base_lr: The learning rate that `lr_scale` multiplies.
        weight_decay: AdamW decoupled weight decay of weight matrices.
        stage: The current unfreezing stage; groups of later stages start with lr 0.

    Returns:
        Dicts with `params`, `lr`, `weight_decay`, `name`, `base_lr`, `lr_scale`, `active`
        (1.0 or 0.0), `stage` and `depth`, in a stable order (by stage, then first appearance).

    Raises:
        ValueError: a parameter appears twice, or two parameters of one group disagree on
            their lr scale or stage.
    """
    if base_lr <= 0 or weight_decay < 0:
        raise ValueError(f"need base_lr > 0 and weight_decay >= 0, got {base_lr}, {weight_decay}")
    groups: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for spec in specs:
        if id(spec.param) in seen:
            raise ValueError(f"parameter {spec.name} is listed twice")
        seen.add(id(spec.param))
        decays = takes_weight_decay(spec.name, spec.param)
        name = group_name(spec.role, spec.depth, decays)
        group = groups.setdefault(name, _new_group(name, spec, base_lr, weight_decay, decays))
        if (group["lr_scale"], group["stage"]) != (spec.lr_scale, spec.stage):
            raise ValueError(f"{spec.name} disagrees with the other parameters of group {name}")
        group["params"].append(spec.param)
    ordered = sorted(groups.values(), key=lambda group: group["stage"])  # stable
    set_stage(ordered, stage)
    return ordered


def _new_group(
    name: str, spec: ParamSpec, base_lr: float, weight_decay: float, decays: bool
) -> dict[str, Any]:
    return {
        "name": name,
        "params": [],
        "base_lr": base_lr,
        "lr_scale": spec.lr_scale,
        "lr": base_lr * spec.lr_scale,
        "weight_decay": weight_decay if decays else 0.0,
        "stage": spec.stage,
        "depth": spec.depth,
        "active": 1.0,
    }


def set_stage(groups: Iterable[dict[str, Any]], stage: int) -> list[str]:
    """Activate the groups whose stage has started; set each one's lr at once.

    The lr uses the schedule factor `GroupLRSchedule` last wrote into the group (`lr_factor`;
    1.0 before any schedule), so a group unfrozen at an epoch start trains at the right rate on
    its very first step, and a group not yet unfrozen has lr exactly 0.

    Returns:
        The names of the groups this call activated.
    """
    activated = []
    for group in groups:
        active = 1.0 if group.get("stage", 0) <= stage else 0.0
        if active and not group.get("active", 1.0):
            activated.append(str(group.get("name")))
        group["active"] = active
        group["lr"] = _group_lr(group, group.get("lr_factor", 1.0))
    return activated


def _group_lr(group: dict[str, Any], factor: float) -> float:
    return float(group["base_lr"] * group["lr_scale"] * group["active"] * factor)


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, decay: Decay, min_lr_ratio: float
) -> float:
    """The multiplier of the peak lr for optimizer step `step` (1-based).

    Warm-up: `step / warmup_steps` for steps 1..W, so the first step already trains (unlike
    DeepSpeed's WarmupDecayLR, which gives lr 0 to its first steps). Then, with progress
    p = (step - W) / (T - W) in (0, 1]: linear `1 - (1 - m) p`, cosine
    `m + (1 - m)(1 + cos(pi p)) / 2`, constant 1; steps past T keep the final factor.
    """
    if warmup_steps and step <= warmup_steps:
        return max(step, 0) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if decay == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GroupLRSchedule:
    """Warm-up then decay, per group: lr = base_lr * lr_scale * active * factor(step).

    Like `torch.optim.lr_scheduler.LambdaLR`, it sets the rates for the first step when built,
    and `step()` after each optimizer step sets them for the next one. Groups without the keys
    `build_param_groups` writes train at their own `lr` with scale 1, always active. Under
    DeepSpeed give it `engine.optimizer` and leave `scheduler` out of the DeepSpeed config.
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        warmup_steps: int,
        total_steps: int,
        decay: Decay = "linear",
        min_lr_ratio: float = 0.0,
    ) -> None:
        """Record each group's base lr and set the rates of the first step.

        Raises:
            ValueError: a negative warm-up, fewer than one total step, a warm-up longer than
                training, an unknown decay or a `min_lr_ratio` outside [0, 1].
        """
        if warmup_steps < 0 or total_steps < 1 or warmup_steps > total_steps:
            raise ValueError(
                f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, got "
                f"warmup_steps={warmup_steps}, total_steps={total_steps}"
            )
        if decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.optimizer = optimizer
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.decay: Decay = decay
        self.min_lr_ratio = min_lr_ratio
        self.steps_done = 0
        for group in optimizer.param_groups:
            group.setdefault("base_lr", group["lr"])
            group.setdefault("lr_scale", 1.0)
            group.setdefault("active", 1.0)
        self.refresh()

    def factor(self) -> float:
        """The schedule factor of the next optimizer step."""
        return lr_factor(
            self.steps_done + 1,
            self.warmup_steps,
            self.total_steps,
            self.decay,
            self.min_lr_ratio,
        )

    def refresh(self) -> None:
        """(Re)set every group's lr for the next step, e.g. after groups were activated."""
        factor = self.factor()
        for group in self.optimizer.param_groups:
            group["lr_factor"] = factor
            group["lr"] = _group_lr(group, factor)

    def step(self) -> None:
        """Count one optimizer step and set the rates of the next one."""
        self.steps_done += 1
        self.refresh()

    def get_last_lr(self) -> list[float]:
        """The lr each group trains at on the next step."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The step count and the settings, for a checkpoint."""
        return {
            "steps_done": self.steps_done,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "decay": self.decay,
            "min_lr_ratio": self.min_lr_ratio,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved step; the settings must be the ones this schedule has.

        Raises:
            ValueError: naming the first setting that differs from the checkpoint's.
        """
        for key, value in self.state_dict().items():
            if key != "steps_done" and state.get(key) != value:
                raise ValueError(
                    f"schedule checkpoint has {key}={state.get(key)!r}, this run {value!r}"
                )
        self.steps_done = int(state["steps_done"])
        self.refresh()
