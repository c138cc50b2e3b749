"""The `train.model` and `train.electra` sections: which model to pretrain, and the ELECTRA pair.

Only the config models and the names they use (families, sizes, aliases) live here, so that a
recipe validates without importing torch or transformers (`lmpipe config` answers at once). What
they mean is in the modules that use them: `training/models/models.py` (families, presets, the
transformers config) and `electra.py`, which re-export these names. `train.distillation`
(`DistillConfig`) is in `training/pretrain/config.py`: it names a base model
(`training.registry.model_ref`), whose resolution imports the model code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    pad_vocab_to_multiple_of: int = Field(
        64,
        ge=1,
        le=4096,
        description="Embedding and output rows are padded up to a multiple of this, so the "
        "vocabulary matmuls run on tensor-core shapes (Megatron's "
        "make-vocab-size-divisible-by); the padded rows are masked out of every loss and "
        "prediction and cut off at export. 1 pads nothing.",
    )

    @field_validator("family", mode="before")
    @classmethod
    def _alias(cls, value: Any) -> Any:
        return ALIASES.get(value, value) if isinstance(value, str) else value


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
