"""The `train` section: what to pretrain, on how many workers, and how (optimizer, precision, ZeRO).

The DeepSpeed dict is derived from this (`deepspeed_config`), never hand-written; extra
DeepSpeed keys can still be passed through `deepspeed_extra`. The sections it shares with
fine-tuning are the runtime's (`training/runtime/config.py`: scale, guard, checkpoints; what
`precision: auto` means, `training/runtime/precision.py`); the model's and distillation's are in
`training/models/config.py`. Nothing here imports torch, so a recipe validates at once.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.models.config import (
    Attention,
    DistillConfig,
    DocumentAttention,
    ElectraConfig,
    ModelConfig,
    document_attention,
)
from training.pretrain.length_schedule import LengthSchedule
from training.runtime.config import CheckpointConfig, GuardConfig, ScaleConfig
from training.runtime.deepspeed import adamw_section, engine_config, merge
from training.runtime.precision import AutoPrecision


class OptimConfig(BaseModel):
    """AdamW with warm-up then decay; no weight decay on biases and norms."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-6, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(
        0.01, ge=0, description="Decoupled weight decay (not on biases/norms)."
    )
    grad_clip: float = Field(
        1.0, ge=0, description="Max global gradient norm; 0 turns clipping off."
    )
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps from 0 to `lr`.")
    decay: Literal["linear", "cosine", "constant"] = Field(
        "linear", description="Learning-rate decay after warm-up, down to `min_lr_ratio * lr`."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate / peak.")


class EvalConfig(BaseModel):
    """Held-out evaluation on the examples' validation split."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    every_steps: int = Field(50, ge=1, description="Evaluate every N steps (and at the end).")
    max_samples: int = Field(512, ge=1, description="Validation examples per evaluation.")


class TrainConfig(AutoPrecision):
    """Pretraining: model, batch, optimizer, precision, ZeRO stage, checkpoints, evaluation."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    model: ModelConfig = Field(default_factory=ModelConfig)
    max_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    global_batch_size: int = Field(32, ge=1, description="Samples per optimizer step, all ranks.")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per forward pass on one rank; None (default): the rank's whole "
        "share of the global batch, so no gradient accumulation. Set it when that share does "
        "not fit in memory.",
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Compute precision. auto (default) is bf16 on a GPU (scale.use_gpu) and on "
        "a CPU with native bf16 matrix instructions (AVX512-BF16 or AMX), fp32 elsewhere; the "
        "resolved value is what the config records. fp16 needs a GPU (loss scaling). bf16 "
        "on a CPU without native bf16 (no GPU, no ray.address) is refused when the config "
        "loads, unless allow_emulated_bf16.",
    )
    allow_emulated_bf16: bool = Field(
        False,
        description="Allow precision bf16 on this machine's CPU although it has no native bf16 "
        "matrix instructions (emulated: about 100x slower than fp32 per matmul); for "
        "benchmarks and tests that compare precisions on purpose.",
    )
    zero_stage: int = Field(
        0,
        ge=0,
        le=3,
        description="DeepSpeed ZeRO stage. 0 (default, as in DeepSpeed itself) keeps a whole "
        "optimizer state on every worker; 1, 2 and 3 partition the optimizer state, then the "
        "gradients, then the weights across workers to fit larger models, at some cost per "
        "step (ZeRO 2 on one worker: about 10% of a CPU step).",
    )
    compile: bool = Field(False, description="torch.compile the model.")
    compile_scope: Literal["model_and_loss", "modules"] = Field(
        "model_and_loss",
        description="What `compile` compiles: model_and_loss (the forward pass and the loss as "
        "one graph, so the logits' masking, cast and cross-entropy fuse) or modules (each "
        "top-level module of the model apart). ZeRO 3 always compiles modules.",
    )
    sparse_mlm: bool = Field(
        True, description="Compute masked-LM logits only at masked positions (as BERT does)."
    )
    document_masking: bool = Field(
        False, description="causal: restart positions and block attention at document starts."
    )
    attention: Attention = Field(
        "auto",
        description="How document-masked causal blocks attend. dense: a (B, 1, L, L) mask "
        "through SDPA (no flash kernel). flex: FlexAttention block masks built from the "
        "document ids (needs a GPU, document_masking, a causal family and no attention "
        "dropout). auto (default): flex wherever it can train, else dense. Blocks of one "
        "document, and unpadded encoder batches, get no mask at all either way.",
    )
    length_schedule: LengthSchedule | None = Field(
        None,
        description="Sequence length by step (training/pretrain/length_schedule.py): `staged` "
        "stages or "
        "`alternate` short and full-length steps; None trains at the examples' length.",
    )
    electra: ElectraConfig = Field(
        default_factory=ElectraConfig,
        description="model.family electra: the generator and the discriminator loss weight.",
    )
    distillation: DistillConfig | None = Field(
        None,
        description="model.family distilbert: distil from this BERT teacher "
        "(training/models/distill.py); "
        "None trains DistilBERT with MLM alone.",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log_every_steps: int = Field(
        20,
        ge=1,
        description="Read the training metrics from the device every N steps (also before "
        "evaluation, checkpoints and the end): steps.jsonl gets every step, MLflow every N-th "
        "and the last of each read.",
    )
    log_sample_ids: bool = Field(
        False, description="Write the global sample ids each rank consumes, per step (audits)."
    )
    verify_shards: bool = Field(True, description="Check each example shard's sha256 at start.")
    prefetch: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Build the next step's batches (gather, mask, pin) in a background thread "
        "while the device runs this step. auto: on a GPU (the step then never waits on "
        "NumPy); off on a CPU, whose cores run the step itself. It changes when the batches "
        "are built, not what they hold.",
    )
    deepspeed_extra: dict[str, Any] = Field(
        default_factory=dict, description="Extra DeepSpeed config keys, merged over the generated."
    )
    model_name: str | None = Field(
        None, description="Registered model name; default <run name>-<family>."
    )
    alias: str = Field(
        "candidate",
        description="Registry alias that moves to the new model version only when it is no worse "
        "than the version holding it: lower or equal eval_loss on the same examples (it also "
        "moves when they cannot be compared; docs/export.md, 'Aliases'). `newest` always moves.",
    )

    @model_validator(mode="after")
    def _distillation_needs_distilbert(self) -> TrainConfig:
        if self.distillation is not None and self.model.family != "distilbert":
            raise ValueError(
                "train.distillation trains a DistilBERT student: set train.model.family to "
                f"distilbert (it is {self.model.family})"
            )
        return self

    @model_validator(mode="after")
    def _fp16_needs_gpu(self) -> TrainConfig:
        if self.precision == "fp16" and not self.scale.use_gpu:
            raise ValueError("precision fp16 needs a GPU (scale.use_gpu); use bf16 or fp32 on CPU")
        return self

    @model_validator(mode="after")
    def _attention_can_train(self) -> TrainConfig:
        self.document_attention()  # raises, naming train.attention, where flex cannot train
        return self

    def document_attention(self) -> DocumentAttention:
        """How this run's document-masked blocks attend: `attention` with `auto` resolved."""
        return document_attention(
            self.attention, self.model, self.document_masking, self.scale.use_gpu
        )

    def micro_batch(self, world_size: int) -> int:
        """Samples per forward pass on one of `world_size` ranks (`micro_batch_size` resolved)."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        if self.global_batch_size % world_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} must be a multiple of the "
                f"workers ({world_size}), or set train.micro_batch_size"
            )
        return self.global_batch_size // world_size

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step; the global batch must split evenly."""
        micro = self.micro_batch(world_size)
        if self.global_batch_size % (micro * world_size):
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} must be a multiple of "
                f"train.micro_batch_size ({micro}) x workers ({world_size})"
            )
        return self.global_batch_size // (micro * world_size)


def deepspeed_config(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config for `cfg` on `world_size` data-parallel ranks.

    `cfg.deepspeed_extra` is merged last (nested dicts merge key by key), so a user can set
    any DeepSpeed key the typed config does not cover.
    """
    opt = cfg.optim
    ds = engine_config(
        global_batch=cfg.global_batch_size,
        micro_batch=cfg.micro_batch(world_size),
        accumulation=cfg.accumulation_steps(world_size),
        grad_clip=opt.grad_clip,
        zero_stage=cfg.zero_stage,
        precision=cfg.precision,
        optimizer=adamw_section(opt.lr, opt.betas, opt.eps, opt.weight_decay),
    )
    if cfg.zero_stage == 3:
        # Export gathers fp32 weights from the shards (zero_to_fp32); no 16-bit copy on save.
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    # No "scheduler": the loop sets every group's rate (training/runtime/schedule.py), so the
    # first step already trains (DeepSpeed's WarmupDecayLR gave it lr 0).
    ds["fp16"] = {"enabled": cfg.precision == "fp16", "initial_scale_power": 16}
    ds["wall_clock_breakdown"] = False
    # DeepSpeed's throughput timer (on by default) synchronises the device at the start of
    # every forward and at every step from the third on; lmpipe measures its own throughput.
    ds["timers"] = {"throughput": {"enabled": False}}
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
