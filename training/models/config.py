"""Which model: `train.model`, `train.electra`, `train.distillation`, and a base model's source.

Only the config models and the names they use (families, sizes, aliases) live here, so that a
recipe validates without importing torch or transformers (`lmpipe config` answers at once). What
they mean is in the modules that use them: `training/models/models.py` (families, presets, the
transformers config), `attention.py` (the FlexAttention implementation of document-masked causal
blocks), `electra.py` and `distill.py`, which re-export these names. `BaseModelRef` (a local
directory or a registry version: fine-tuning's base, distillation's teacher) is resolved by
`training/tracking/model_ref.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Family = Literal[
    "bert",
    "roberta",
    "gpt2",
    "llama",
    "t5",
    "albert",
    "distilbert",
    "electra",
    "deberta-v2",
    "bart",
    "mistral",
    "mixtral",
    "xlm-roberta",
    "longformer",
    "big_bird",
]
Size = Literal["tiny", "mini", "small", "base", "large"]
Value = int | float | str | bool
#: `train.attention`: how document-masked causal blocks attend (docs/pretraining.md).
Attention = Literal["auto", "dense", "flex"]
#: What `auto` resolves to: the dense 4-D mask through SDPA, or FlexAttention block masks.
DocumentAttention = Literal["dense", "flex"]

#: Friendlier names accepted for `model.family`; a family's own name is its transformers
#: `model_type`, so an export's config.json names its family.
ALIASES: dict[str, Family] = {
    "deberta": "deberta-v2",
    "xlmr": "xlm-roberta",
    "bigbird": "big_bird",
}


class ModelConfig(BaseModel):
    """Which model to pretrain: a family, a named size, and any transformers config field."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    family: Family = Field(
        "bert",
        description="Architecture (docs/models.md): bert (MLM + NSP/SOP), albert (MLM + SOP), "
        "roberta, xlm-roberta, distilbert, deberta-v2, longformer, big_bird (MLM), electra "
        "(replaced-token detection), gpt2, llama, mistral, mixtral (causal LM), t5 (span "
        "corruption), bart (denoising). Aliases: deberta, xlmr, bigbird.",
    )
    size: Size = Field(
        "tiny", description="Named shape preset (docs/models.md); tiny is for tests and demos."
    )
    overrides: dict[str, Value] = Field(
        default_factory=dict,
        description="Any field of the transformers config, e.g. {num_hidden_layers: 4}; "
        "wins over the size preset.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass (gradient checkpointing) to "
        "save memory on large models.",
    )
    dropout: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Override every dropout probability of the family (None: the preset's).",
    )
    implementation: Literal["fast", "transformers"] = Field(
        "fast",
        description="fast: train the family's lmpipe subclass of its transformers class where "
        "it has one (training/models/fast/: the same parameters, hence the same checkpoint and "
        "a stock export, with a leaner forward for the common pretraining case); "
        "transformers: the stock class's own forward.",
    )
    pad_vocab_to_multiple_of: int = Field(
        64,
        ge=1,
        le=4096,
        description="Embedding and output rows are padded up to a multiple of this, so the "
        "vocabulary matmuls run on tensor-core shapes (Megatron's "
        "make-vocab-size-divisible-by); the padded rows are masked out of every loss and "
        "prediction and cut off at export. 1 pads nothing.",
    )

    bias: bool = Field(
        True,
        description="false: no biases, as nanoGPT's bias=False (gpt2 only): every Conv1D and "
        "LayerNorm bias is zero and not trained, and the fast path leaves it out of the "
        "computation. The export is a stock GPT-2 whose biases are zero (its logits are the "
        "trained module's).",
    )

    @field_validator("family", mode="before")
    @classmethod
    def _alias(cls, value: Any) -> Any:
        return ALIASES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _bias_for_gpt2(self) -> ModelConfig:
        if not self.bias and self.family != "gpt2":
            raise ValueError(
                f"model.bias false is for the gpt2 family, not {self.family!r}: its stock "
                "class has no bias-free form lmpipe trains"
            )
        return self


class ElectraConfig(BaseModel):
    """The generator and the loss weight of ELECTRA pretraining (`train.electra`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    generator_size: str | None = Field(
        None,
        description="Named generator size (training/models/presets.py electra_generator); None: "
        "the "
        "published generator of the discriminator's size.",
    )
    generator_overrides: dict[str, int | float | str | bool] = Field(
        default_factory=dict,
        description="ElectraConfig fields of the generator, over its preset (embedding_size is "
        "always the discriminator's: the embeddings are shared).",
    )
    rtd_weight: float = Field(
        50.0, gt=0, description="Weight of the discriminator loss against the generator MLM loss."
    )
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature of the generator's replacements."
    )


#: The families that pack documents into causal blocks, with the config field of their
#: attention-probability dropout and transformers' default for it (FlexAttention has none).
CAUSAL_ATTENTION_DROPOUT: dict[str, tuple[str, float]] = {
    "gpt2": ("attn_pdrop", 0.1),
    "llama": ("attention_dropout", 0.0),
    "mistral": ("attention_dropout", 0.0),
    "mixtral": ("attention_dropout", 0.0),
}


def attention_dropout(model: ModelConfig) -> float:
    """The attention dropout a causal family's model will have (0 for any other family)."""
    if model.family not in CAUSAL_ATTENTION_DROPOUT:
        return 0.0
    field, default = CAUSAL_ATTENTION_DROPOUT[model.family]
    if field in model.overrides:  # overrides win over `dropout`, as in the built config
        return float(model.overrides[field])
    return default if model.dropout is None else model.dropout


def flex_attention_problem(model: ModelConfig, document_masking: bool, use_gpu: bool) -> str | None:
    """Why `train.attention` flex cannot train this run; None when it can."""
    families = ", ".join(CAUSAL_ATTENTION_DROPOUT)
    if model.family not in CAUSAL_ATTENTION_DROPOUT:
        return (
            f"train.attention flex runs document-masked causal blocks, and train.model.family "
            f"{model.family} packs none (flex is for {families})"
        )
    if not document_masking:
        return (
            "train.attention flex changes only document-masked blocks, and "
            "train.document_masking is false (causal blocks already run SDPA's causal kernel)"
        )
    if not use_gpu:
        return (
            "train.attention flex needs a GPU (train.scale.use_gpu): FlexAttention has no "
            "backward pass on a CPU"
        )
    dropout = attention_dropout(model)
    if dropout > 0:
        field = CAUSAL_ATTENTION_DROPOUT[model.family][0]
        return (
            f"train.attention flex has no attention dropout, and {model.family}'s {field} is "
            f"{dropout}: set train.model.dropout=0 (or train.model.overrides.{field}=0)"
        )
    return None


def document_attention(
    attention: Attention, model: ModelConfig, document_masking: bool, use_gpu: bool
) -> DocumentAttention:
    """What `train.attention` means for this run: `auto` is flex wherever flex can train.

    Raises:
        ValueError: `attention` is flex and `flex_attention_problem` names why it cannot be.
    """
    problem = flex_attention_problem(model, document_masking, use_gpu)
    if attention == "flex" and problem is not None:
        raise ValueError(f"{problem}; or set train.attention to auto or dense")
    if attention == "auto":
        return "dense" if problem else "flex"
    return attention


class BaseModelRef(BaseModel):
    """Where the model to fine-tune comes from: a local HF directory or a registry version."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: Path | None = Field(
        None, description="A local Hugging Face model directory (safetensors weights only)."
    )
    registry_name: str | None = Field(
        None, description="A registered MLflow model name, e.g. demo-bert."
    )
    version: str = Field(
        "candidate", description="Registry alias or version number of `registry_name`."
    )

    @model_validator(mode="after")
    def _one_source(self) -> BaseModelRef:
        if (self.path is None) == (self.registry_name is None):
            raise ValueError("set exactly one of `path` and `registry_name`")
        return self


class DistillConfig(BaseModel):
    """The teacher and the loss weights of distillation (`train.distillation`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    teacher: BaseModelRef = Field(
        description="The BERT teacher: a local HF directory (`path`) or a registry version."
    )
    temperature: float = Field(2.0, gt=0, description="Softmax temperature of the soft targets.")
    alpha_kd: float = Field(5.0, ge=0, description="Weight of the soft-target KL loss.")
    alpha_mlm: float = Field(2.0, ge=0, description="Weight of the student's masked-LM loss.")
    alpha_cos: float = Field(1.0, ge=0, description="Weight of the hidden-state cosine loss.")
    student_layers: int | None = Field(
        None, ge=1, description="Student depth; None: half the teacher's layers."
    )
