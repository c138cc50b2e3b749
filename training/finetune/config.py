"""The `finetune` section: which model, which strategy, how long, how it stops, on what workers.

The downstream data itself is described in `tasks/downstream/downstream.py` (`DatasetConfig`); this
section only says how to train on it. The features and generation settings are sections of their
own light modules, composed here. The strategy section (`StrategyConfig`, with its adapter, LoRA
and prompt-tuning settings) and the `compare` section (`CompareConfig`) live here too, apart from
the code they configure (`strategies.py`, `adapters.py`, `compare.py`, which re-export them), so
that a recipe validates without importing torch, transformers or Prefect.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.finetune.features.base import FeatureConfig
from training.models.config import BaseModelRef
from training.runtime.config import ScaleConfig
from training.runtime.precision import AutoPrecision
from training.scoring.config import GenerationSettings


class AdapterConfig(BaseModel):
    """Bottleneck adapters: size, placement and nonlinearity."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    reduction_factor: int = Field(
        16, ge=1, description="Bottleneck width = hidden size // reduction_factor (at least 1)."
    )
    bottleneck: int | None = Field(
        None, ge=1, description="Explicit bottleneck width; wins over reduction_factor."
    )
    placement: Literal["both", "attention", "ffn"] = Field(
        "both",
        description="After the attention and the feed-forward output (both: Houlsby), or only "
        "one of them (ffn: Pfeiffer).",
    )
    activation: Literal["relu", "gelu", "silu", "tanh"] = Field(
        "gelu",
        description="Nonlinearity between the down- and up-projection. With `up` starting at "
        "zero, a ReLU unit that is dead on the first batches never gets a gradient; GELU's does.",
    )

    def width(self, hidden: int) -> int:
        """The bottleneck width for a sub-layer of width `hidden`."""
        return self.bottleneck or max(1, hidden // self.reduction_factor)


class LoraSettings(BaseModel):
    """LoRA (via peft) on the attention projections."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    r: int = Field(8, ge=1, description="Rank of the low-rank update.")
    alpha: float = Field(16.0, gt=0, description="Scale: the update is (alpha / r) * B A.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | None = Field(
        None,
        description="Module names to adapt; default per family: bert/roberta query,value; "
        "gpt2 c_attn; llama q_proj,v_proj; t5 q,v.",
    )


class PromptSettings(BaseModel):
    """Prompt tuning (via peft): trainable soft-prompt embeddings before the input."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    num_virtual_tokens: int = Field(20, ge=1, description="Soft-prompt length in tokens.")
    init: Literal["sample_vocab", "random"] = Field(
        "sample_vocab", description="Start from randomly sampled vocabulary embeddings, or N(0,1)."
    )


StrategyName = Literal[
    "full", "feature_extraction", "progressive_unfreezing", "adapters", "prompt_tuning", "lora"
]
ExportFormat = Literal["merged", "adapter"]
#: Strategies whose result is one set of transformers weights (LoRA once merged).
MERGEABLE = frozenset({"full", "feature_extraction", "progressive_unfreezing", "lora"})
#: Strategies that train an adapter which can be saved apart from the base model.
ADAPTER_STRATEGIES = frozenset({"lora", "prompt_tuning", "adapters"})

_OWNERS = {
    "unfreeze_every_epochs": "progressive_unfreezing",
    "adapter": "adapters",
    "lora": "lora",
    "prompt": "prompt_tuning",
}


class StrategyConfig(BaseModel):
    """How fine-tuning adapts the pretrained model (docs/strategies.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: StrategyName = Field("full", description="The transfer strategy.")
    head_lr_mult: float = Field(
        1.0, gt=0, description="Head lr = lr * head_lr_mult (discriminative learning rates)."
    )
    layer_decay: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Layer-wise lr decay: depth d of L trains at lr * layer_decay^(L - d) "
        "(full and progressive_unfreezing).",
    )
    unfreeze_every_epochs: int = Field(
        1, ge=1, description="progressive_unfreezing: epochs per stage (head, then one layer)."
    )
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    prompt: PromptSettings = Field(default_factory=PromptSettings)
    export: Literal["auto", "merged", "adapter"] = Field(
        "auto",
        description="How the fine-tuned model is saved (docs/strategies.md, Exports). merged: "
        "one transformers model that from_pretrained loads (full, feature_extraction, "
        "progressive_unfreezing, lora). adapter: the frozen base model in base_model/ and the "
        "adapter beside it (peft's adapter_config.json + adapter_model.safetensors for lora and "
        "prompt_tuning, lmpipe's adapters.json for adapters). auto: adapter where the strategy "
        "trains one (lora, prompt_tuning, adapters), else merged.",
    )

    @model_validator(mode="after")
    def _composes(self) -> StrategyConfig:
        if self.layer_decay is not None and self.name not in ("full", "progressive_unfreezing"):
            raise ValueError(
                f"layer_decay scales the lr of the model's own layers, which {self.name} does "
                "not train; use it with full or progressive_unfreezing"
            )
        if self.head_lr_mult != 1.0 and self.name == "feature_extraction":
            raise ValueError(
                "head_lr_mult has no effect with feature_extraction (only the head trains): "
                "set the learning rate instead"
            )
        if self.export == "merged" and self.name not in MERGEABLE:
            raise ValueError(
                f"export merged: {self.name} cannot be merged into the model's weights (a soft "
                "prompt is extra input, bottleneck adapters are nonlinear); use export adapter"
            )
        if self.export == "adapter" and self.name not in ADAPTER_STRATEGIES:
            raise ValueError(f"export adapter: {self.name} trains no adapter; use export merged")
        defaults = StrategyConfig.model_construct()
        for field, owner in _OWNERS.items():
            # Compared with the default (not `model_fields_set`): a dumped config, defaults
            # included, must validate again (Ray workers, run records).
            if getattr(self, field) != getattr(defaults, field) and self.name != owner:
                raise ValueError(f"strategy.{field} only applies to name: {owner}, not {self.name}")
        return self

    def export_format(self) -> ExportFormat:
        """`export` with auto resolved: adapter where the strategy trains one, else merged."""
        if self.export != "auto":
            return self.export
        # A peft strategy gives a peft adapter, as peft users expect (#40); LoRA merges on request.
        return "adapter" if self.name in ADAPTER_STRATEGIES else "merged"


class StoppingConfig(BaseModel):
    """Early stopping on a validation metric, restoring the best epoch's weights."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    metric: str | None = Field(
        None,
        description="Validation metric to watch, by its name (accuracy; val_accuracy, its "
        "MLflow name, means the same); default the task's primary metric.",
    )
    patience: int = Field(3, ge=1, description="Epochs without improvement before training stops.")
    min_delta: float = Field(0.0, ge=0, description="Smallest change that counts as improvement.")


class LossConfig(BaseModel):
    """Loss options for imbalanced classification."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    class_weights: Literal["none", "balanced"] | list[float] = Field(
        "none",
        description="none, balanced (inverse train frequency, docs/strategies.md), or one "
        "weight per label.",
    )
    focal_gamma: float | None = Field(
        None, ge=0, description="Focal loss focusing parameter; None is cross entropy."
    )


class FinetuneConfig(AutoPrecision):
    """Fine-tuning: base model, strategy, optimisation, stopping, engine and scale."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    base: BaseModelRef | None = Field(
        None, description="Model to fine-tune; default the model the pretrain stage exported."
    )
    random_init: bool = Field(
        False, description="Same architecture, fresh random weights (the no-pretraining baseline)."
    )
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    features: FeatureConfig = Field(default_factory=FeatureConfig)
    source_prefix: str = Field(
        "", description='T5 text-to-text prefix, e.g. "summarize: " (seq2seq tasks).'
    )
    epochs: int = Field(3, ge=1, description="Passes over the training split (at most).")
    batch_size: int = Field(32, ge=1, description="Examples per optimizer step, all ranks.")
    micro_batch_size: int = Field(16, ge=1, description="Examples per forward pass on one rank.")
    eval_batch_size: int = Field(64, ge=1, description="Examples per evaluation forward pass.")
    lr: float = Field(5e-5, gt=0, description="Peak learning rate (of the head; see strategy).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not biases/norms).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    warmup_ratio: float = Field(0.1, ge=0, lt=1, description="Warm-up steps / total steps.")
    decay: Literal["linear", "cosine", "constant"] = Field(
        "linear", description="Learning-rate decay after warm-up."
    )
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient norm; 0 is off.")
    early_stopping: StoppingConfig | None = Field(
        default_factory=StoppingConfig, description="None trains every epoch and keeps the last."
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    deepspeed: bool = Field(False, description="Train with DeepSpeed instead of plain DDP.")
    zero_stage: int = Field(
        0,
        ge=0,
        le=2,
        description="DeepSpeed ZeRO stage (deepspeed: true). Fine-tuning keeps whole weights on "
        "every rank (best-epoch snapshots, evaluation, progressive unfreezing), so at most 2.",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "fp32",
        description="Compute precision. auto resolves as train.precision does (bf16 on a GPU "
        "and on a CPU with native bf16 matrix instructions, fp32 elsewhere) when the config "
        "loads. bf16 on a CPU without native bf16 (no GPU, no ray.address) is refused then, "
        "unless allow_emulated_bf16.",
    )
    allow_emulated_bf16: bool = Field(
        False,
        description="Allow precision bf16 on this machine's CPU although it has no native bf16 "
        "matrix instructions (emulated: about 100x slower than fp32 per matmul).",
    )
    scale: ScaleConfig = Field(
        default_factory=lambda: ScaleConfig(num_workers=1, max_failures=0),
        description="Ray Train workers.",
    )
    generation: GenerationSettings = Field(
        default_factory=GenerationSettings,
        description="Decoding for seq2seq and causal-LM evaluation.",
    )
    max_eval_examples: int | None = Field(
        None, ge=1, description="Cap on validation/test examples evaluated (generation is slow)."
    )
    register_model: bool = Field(True, description="Register the fine-tuned export in MLflow.")
    model_name: str | None = Field(
        None, description="Registered model name; default <run name>-<task>."
    )
    alias: str = Field(
        "candidate",
        description="Registry alias that moves to the new version only when it is no worse than "
        "the version holding it: the task's primary test metric on the same prepared data (it "
        "also moves when they cannot be compared; docs/export.md, 'Aliases'). `newest` always "
        "moves.",
    )
    deepspeed_extra: dict[str, Any] = Field(
        default_factory=dict, description="Extra DeepSpeed keys merged over the generated ones."
    )

    PRECISION_DEFAULT: ClassVar[str] = "fp32"

    @model_validator(mode="after")
    def _zero_needs_deepspeed(self) -> FinetuneConfig:
        if self.zero_stage and not self.deepspeed:
            raise ValueError("zero_stage needs deepspeed: true")
        return self

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step; the batch must split evenly."""
        per_step = self.micro_batch_size * world_size
        if self.batch_size % per_step:
            raise ValueError(
                f"finetune.batch_size={self.batch_size} must be a multiple of "
                f"finetune.micro_batch_size ({self.micro_batch_size}) x workers ({world_size})"
            )
        return self.batch_size // per_step


class CompareEntry(BaseModel):
    """One row of the comparison: a strategy, from pretrained or from random weights."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    random_init: bool = Field(False, description="Start from random weights (the baseline).")
    label: str | None = Field(None, description="Row name; default the strategy name.")

    def name(self) -> str:
        """The row's name in the table and chart."""
        if self.label:
            return self.label
        return self.strategy.name + (" (random init)" if self.random_init else "")


def _default_entries() -> list[CompareEntry]:
    names = ("feature_extraction", "full", "lora")
    return [CompareEntry(strategy=StrategyConfig(name=n)) for n in names]


class CompareConfig(BaseModel):
    """Which strategies to compare, over which seeds, and on which test metric."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    entries: list[CompareEntry] = Field(
        default_factory=_default_entries, min_length=1, description="Rows of the comparison."
    )
    seeds: list[int] = Field(
        default_factory=lambda: [0, 1, 2], min_length=1, description="Seeds per entry."
    )
    metric: str | None = Field(
        None, description="Test metric to compare; default the task's primary metric."
    )
    experiment: str | None = Field(
        None, description="MLflow experiment for every run; default <experiment>-compare."
    )
