"""Transfer strategies: which parameters fine-tuning may change, at what lr, and from when.

`apply_strategy(model, cfg, head_prefixes)` freezes, wraps or extends a transformers task model
for one strategy (`finetune.strategy`) and returns a `StrategyPlan`: the model to train, its
optimizer groups (`training/runtime/schedule.py`), the names it may change, the unfreezing stage per
epoch, and the export (`save_export`: merged, or the base model plus the adapter). The pieces
compose: `head_lr_mult` (discriminative lr) goes with every strategy that trains a head,
`layer_decay` with `full` and `progressive_unfreezing`. Bottleneck adapters and the adapter
exports live in `training/finetune/adapters.py`; LoRA and prompt tuning come from `peft`. Depth
numbering, formulas, worked tables and the export layouts: docs/strategies.md.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from training.finetune import adapters as adapter_lib
from training.finetune.adapters import peft_task_type
from training.finetune.config import MERGEABLE
from training.finetune.config import StrategyConfig as StrategyConfig
from training.finetune.config import StrategyName as StrategyName
from training.models.export import BASE_MODEL_DIR
from training.models.models import FAMILIES
from training.runtime.schedule import (
    ParamSpec,
    build_param_groups,
    layer_index,
    set_stage,
    stack_sizes,
)

#: Top-level task-head modules of the transformers task classes, in lookup order.
HEAD_NAMES = (
    "classifier",
    "pre_classifier",
    "score",
    "qa_outputs",
    "classification_head",
    "lm_head",
    "cls",
)
#: Pretrained language-model heads (often tied to the input embeddings): parameter-efficient
#: strategies leave them frozen.
LM_HEADS = frozenset({"lm_head", "cls"})


def head_prefixes_for(model: torch.nn.Module) -> tuple[str, ...]:
    """The top-level task-head modules of a transformers task model (e.g. `("classifier",)`).

    Raises:
        ValueError: none of `HEAD_NAMES` is a child module with parameters.
    """
    children = {n for n, m in model.named_children() if next(m.parameters(), None) is not None}
    found = tuple(name for name in HEAD_NAMES if name in children)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no known task head among its modules {sorted(children)}"
        )
    return found


def _aliases(model: torch.nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter (tied weights have several), first name first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _check_heads(model: torch.nn.Module, head_prefixes: Sequence[str]) -> None:
    names = [n for aliases in _aliases(model).values() for n in aliases]
    for prefix in head_prefixes or ["<none>"]:
        if not any(_under(n, [prefix]) for n in names):
            raise ValueError(f"head prefix {prefix!r} names no parameter of {type(model).__name__}")


def _body_specs(
    model: torch.nn.Module, cfg: StrategyConfig, heads: Sequence[str]
) -> list[ParamSpec]:
    """Specs for full, feature_extraction and progressive_unfreezing (depth, scale, stage)."""
    aliases = _aliases(model)
    params = dict(model.named_parameters())
    body = {n for n, p in params.items() if not any(_under(a, heads) for a in aliases[id(p)])}
    if cfg.layer_decay is None and cfg.name != "progressive_unfreezing":
        # No depths needed: any architecture works, whatever its parameter names.
        return [
            ParamSpec(n, p, "body", None, 1.0)
            if n in body
            else ParamSpec(n, p, "head", None, cfg.head_lr_mult)
            for n, p in params.items()
            if n not in body or cfg.name != "feature_extraction"
        ]
    enc, total = stack_sizes(sorted(body))
    specs = []
    for name, param in params.items():
        depth = layer_index(name, total, enc) if name in body else total + 1
        scale = (cfg.layer_decay or 1.0) ** (total - depth) if name in body else cfg.head_lr_mult
        stage = total + 1 - depth if cfg.name == "progressive_unfreezing" else 0
        role = "body" if name in body else "head"
        specs.append(ParamSpec(name, param, role, depth, scale, stage))
    return specs


def _adapter_specs(model: PreTrainedModel, cfg: StrategyConfig, heads: Sequence[str]) -> Any:
    """Freeze everything, add adapters, unfreeze task heads; (specs, adapters by site)."""
    trained_heads = _trained_heads(model, heads, cfg)
    model.requires_grad_(False)
    for head in trained_heads:
        model.get_submodule(head).requires_grad_(True)
    added = adapter_lib.add_adapters(model, cfg.adapter)  # fresh parameters: trainable
    specs = [
        ParamSpec(n, p, "adapter", None, 1.0)
        if adapter_lib.ADAPTER_ATTR in n
        else ParamSpec(n, p, "head", None, cfg.head_lr_mult)
        for n, p in model.named_parameters()
        if p.requires_grad
    ]
    return specs, added


def _peft_specs(model: torch.nn.Module, head_lr_mult: float) -> list[ParamSpec]:
    """Specs of the parameters peft left trainable: LoRA, the soft prompt, saved heads."""
    specs = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if ".lora_" in name:
            specs.append(ParamSpec(name, param, "lora", None, 1.0))
        elif name.startswith("prompt_encoder."):
            specs.append(ParamSpec(name, param, "prompt", None, 1.0))
        elif ".modules_to_save." in name:
            specs.append(ParamSpec(name, param, "head", None, head_lr_mult))
        else:
            raise ValueError(f"peft left {name} trainable, which no strategy promises")
    return specs


def _trained_heads(model: torch.nn.Module, heads: Sequence[str], cfg: StrategyConfig) -> list[str]:
    """The heads a parameter-efficient strategy trains: task heads, never pretrained LM heads."""
    trained = [h for h in heads if h not in LM_HEADS]
    if not trained and cfg.head_lr_mult != 1.0:
        raise ValueError(
            f"head_lr_mult has no effect: {cfg.name} leaves the language-model head of "
            f"{type(model).__name__} frozen"
        )
    return trained


def _lora(model: PreTrainedModel, cfg: StrategyConfig, heads: Sequence[str]) -> Any:
    family = adapter_lib.family_of_model(model)
    targets = cfg.lora.target_modules or adapter_lib.LORA_TARGETS.get(family)
    if not targets:
        raise ValueError(f"no default LoRA target modules for {family!r}: set lora.target_modules")
    peft = adapter_lib.load_peft()
    config = peft.LoraConfig(
        task_type=peft_task_type(model),
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(targets),
        fan_in_fan_out=family == "gpt2",  # GPT-2's Conv1D stores weights as (in, out)
        modules_to_save=list(_trained_heads(model, heads, cfg)) or None,
        bias="none",
    )
    return adapter_lib.quiet_peft(peft.get_peft_model, model, config)


def _check_prompt_support(model: torch.nn.Module, task: str) -> None:
    cls = type(model).__name__
    if task in ("TOKEN_CLS", "QUESTION_ANS"):
        raise ValueError(
            f"prompt_tuning cannot train {cls}: peft prepends the virtual tokens, which shifts "
            "the per-token labels and answer positions; use lora or adapters"
        )
    family = adapter_lib.family_of_model(model)
    # Decoder and seq2seq classifiers find the token they classify (the last non-pad, or
    # the eos) from input_ids.
    if task == "SEQ_CLS" and family in FAMILIES and FAMILIES[family].kind != "encoder":
        raise ValueError(
            f"prompt_tuning cannot train {cls}: it finds the token it classifies from "
            "input_ids, which peft replaces by embeddings; use lora or adapters"
        )


def _prompt_tuning(model: PreTrainedModel, cfg: StrategyConfig, heads: Sequence[str]) -> Any:
    task = peft_task_type(model)
    _check_prompt_support(model, task)
    peft = adapter_lib.load_peft()
    config = peft.PromptTuningConfig(
        task_type=task,
        num_virtual_tokens=cfg.prompt.num_virtual_tokens,
        prompt_tuning_init=cfg.prompt.init.upper(),
        modules_to_save=list(_trained_heads(model, heads, cfg)) or None,
    )
    return adapter_lib.quiet_peft(peft.get_peft_model, model, config)


def apply_strategy(
    model: PreTrainedModel, cfg: StrategyConfig, head_prefixes: Sequence[str]
) -> StrategyPlan:
    """Freeze, wrap or extend `model` (in place) for `cfg.name`; return the plan to train it.

    Args:
        model: A transformers task model (e.g. `BertForSequenceClassification`).
        cfg: The `finetune.strategy` section.
        head_prefixes: Top-level names of its task head (`head_prefixes_for(model)`).

    Raises:
        ValueError: a head prefix names no parameter, the strategy does not fit the model (see
            each strategy's message), or a parameter cannot be placed at a layer depth.
    """
    _check_heads(model, head_prefixes)
    extras: dict[str, Any] = {}
    if cfg.name in ("full", "feature_extraction", "progressive_unfreezing"):
        specs = _body_specs(model, cfg, head_prefixes)
        trained = {id(s.param) for s in specs}
        for param in model.parameters():
            param.requires_grad_(id(param) in trained)
        return StrategyPlan(model, cfg, specs, extras)
    if cfg.name == "adapters":
        specs, extras["adapters"] = _adapter_specs(model, cfg, head_prefixes)
        return StrategyPlan(model, cfg, specs, extras)
    wrapped = (_lora if cfg.name == "lora" else _prompt_tuning)(model, cfg, head_prefixes)
    return StrategyPlan(wrapped, cfg, _peft_specs(wrapped, cfg.head_lr_mult), extras)


def _gate(plan: StrategyPlan, stage: int, grad: torch.Tensor) -> torch.Tensor:
    # Zero (not None) gradients keep AdamW's moments at exactly 0 and out of the clip norm
    # until the stage starts; the group's lr 0 stops decoupled weight decay.
    return grad if stage <= plan.stage else torch.zeros_like(grad)


class StrategyPlan:
    """A model prepared for one strategy: what it trains, at what lr, from which epoch."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: StrategyConfig,
        specs: list[ParamSpec],
        extras: dict[str, Any],
    ) -> None:
        """Hold the model and its specs; gate gradients of later stages (progressive)."""
        if not specs:
            raise ValueError(f"strategy {cfg.name} leaves no parameter of the model to train")
        self.model, self.cfg, self.specs, self.extras = model, cfg, specs, extras
        self.stage = 0
        self._groups: list[dict[str, Any]] = []
        self._hooks = [
            s.param.register_hook(functools.partial(_gate, self, s.stage))  # type: ignore[no-untyped-call]
            for s in specs
            if s.stage > 0
        ]
        self._exported = False

    def trainable_names(self) -> list[str]:
        """Every parameter (name in `self.model`) this strategy may ever change."""
        return [s.name for s in self.specs]

    def active_names(self) -> list[str]:
        """The parameters that train in the current stage."""
        return [s.name for s in self.specs if s.stage <= self.stage]

    def num_trainable_parameters(self) -> int:
        """Elements of every parameter the strategy may change."""
        return sum(s.param.numel() for s in self.specs)

    def num_stages(self) -> int:
        """Unfreezing stages (1 unless progressive: head, each layer, then the embeddings)."""
        return 1 + max(s.stage for s in self.specs)

    def param_groups(self, base_lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """Optimizer groups of every parameter the strategy may train (`build_param_groups`).

        Pass them to `torch.optim.AdamW` or `deepspeed.initialize(model_parameters=...)`; both
        keep these dicts, so `on_epoch_start` can switch groups on later.
        """
        self._groups = build_param_groups(self.specs, base_lr, weight_decay, self.stage)
        return self._groups

    def stage_for_epoch(self, epoch: int) -> int:
        """The unfreezing stage of 0-based `epoch`."""
        if self.cfg.name != "progressive_unfreezing":
            return 0
        return epoch // self.cfg.unfreeze_every_epochs

    def on_epoch_start(self, epoch: int) -> list[str]:
        """Enter `epoch`'s stage: its groups get their lr and their gradients; return them."""
        self.stage = self.stage_for_epoch(epoch)
        return set_stage(self._groups, self.stage)

    def _end(self) -> None:
        if self._exported:
            raise RuntimeError("the plan's model was already exported")
        self._exported = True
        for hook in self._hooks:
            hook.remove()

    def merge_and_export_model(self) -> PreTrainedModel:
        """The plain transformers model to save with `save_pretrained` (ends the plan).

        LoRA is merged into the weights.

        Raises:
            ValueError: the strategy cannot be merged (prompt_tuning, adapters): `save_export`.
        """
        if self.cfg.name not in MERGEABLE:
            raise ValueError(f"{self.cfg.name} cannot be merged: save it with save_export")
        self._end()
        wrapper: Any = self.model  # a peft model for lora
        if self.cfg.name == "lora":
            return adapter_lib.quiet_peft(wrapper.merge_and_unload)  # type: ignore[no-any-return]
        return self.model  # type: ignore[return-value]

    def save_export(self, directory: Path, home: Path | None = None) -> list[Path]:
        """Write the trained model as `cfg.export` says to `directory` (ends the plan).

        merged: `save_pretrained` of `merge_and_export_model()`. adapter: the frozen base model
        in `base_model/` and, beside it, peft's adapter files (lora, prompt_tuning) or lmpipe's
        `adapters.json` + `adapters.safetensors` (adapters), with the base's `config.json` at
        the top and no weights there: a plain `from_pretrained` of the directory fails.
        Load any of them with `training.finetune.adapters.load_finetuned`.

        Args:
            directory: Where to write.
            home: Where `directory` is renamed to once written (default `directory`): a peft
                adapter names its base model as `<home>/base_model` (`save_peft_export`).

        Returns:
            The files written.
        """
        if self.cfg.export_format() == "merged":
            self.merge_and_export_model().save_pretrained(directory)
            return sorted(p for p in directory.rglob("*") if p.is_file())
        if self.cfg.name != "adapters":
            self._end()
            return adapter_lib.save_peft_export(self.model, directory, home)
        self._end()
        adapter_lib.remove_adapters(self.model)
        base: Any = self.model  # the model without its adapters, with the trained head
        base.save_pretrained(directory / BASE_MODEL_DIR)
        shutil.copyfile(directory / BASE_MODEL_DIR / "config.json", directory / "config.json")
        adapter_lib.save_adapters(self.extras["adapters"], self.cfg.adapter, directory)
        return sorted(p for p in directory.rglob("*") if p.is_file())
