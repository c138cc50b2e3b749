"""The `finetune` section: which model, which strategy, how long, how it stops, on what workers.

The downstream data itself is described in `tasks/downstream/downstream.py` (`DatasetConfig`); this
section only says how to train on it. Strategies, features and generation settings are sections of
their own modules, composed here.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.evaluate.generation import GenerationSettings
from training.finetune.features.features import FeatureConfig
from training.finetune.strategies import StrategyConfig
from training.pretrain.config import AutoPrecision, ScaleConfig
from training.registry.model_ref import BaseModelRef


class StoppingConfig(BaseModel):
    """Early stopping on a validation metric, restoring the best epoch's weights."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    metric: str | None = Field(
        None, description="Validation metric to watch; default the task's primary metric."
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
    alias: str = Field("candidate", description="Registry alias set on the new version.")
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
