"""The examples stage's config: which objective, how long an example is, and its recipes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.examples.objectives.denoising import DenoisingConfig
from tasks.examples.objectives.masking import MaskConfig
from tasks.examples.objectives.spans import SpanConfig

Objective = Literal["bert", "sop", "roberta", "causal", "span_corruption", "denoising"]


class ExamplesConfig(BaseModel):
    """Which pretraining examples to cut from the encoded corpus, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    objective: Objective = Field(
        "bert",
        description="bert (MLM + next sentence), sop (MLM + sentence order), roberta (MLM on "
        "full sentences), causal (GPT blocks), span_corruption (T5), denoising (BART).",
    )
    max_seq_length: int = Field(
        128,
        ge=8,
        le=65_536,
        description="Tokens per example, specials included (bert, sop, roberta); the encoder "
        "input length (span_corruption); encoder and decoder length (denoising).",
    )
    block_size: int = Field(512, ge=2, le=1 << 20, description="Tokens per causal block.")
    short_seq_prob: float = Field(
        0.1, ge=0.0, le=1.0, description="bert/sop: chance of a shorter random target length."
    )
    next_sentence: Literal["recipe", "balanced"] = Field(
        "recipe",
        description="bert: 'recipe' forces NotNext when a chunk holds one segment, as the "
        "original does; 'balanced' splits such a segment instead, for 50% NotNext.",
    )
    masking: Literal["static", "dynamic"] = Field(
        "static",
        description="static: masks written into the shards (dupe_factor copies); dynamic: "
        "masks drawn at batch time from (seed, epoch, sample index).",
    )
    dupe_factor: int = Field(
        1, ge=1, le=100, description="Static masking: copies of the corpus, each masked anew."
    )
    mask: MaskConfig = Field(default_factory=MaskConfig)
    span: SpanConfig = Field(default_factory=SpanConfig)
    denoising: DenoisingConfig = Field(default_factory=DenoisingConfig)

    @property
    def sequence_length(self) -> int:
        """Tokens per example: `block_size` for causal blocks, else `max_seq_length`."""
        return self.block_size if self.objective == "causal" else self.max_seq_length

    @model_validator(mode="after")
    def _dynamic_has_one_copy(self) -> ExamplesConfig:
        if self.masking == "dynamic" and self.dupe_factor != 1:
            raise ValueError("dupe_factor applies to static masking; dynamic masking needs 1")
        if self.masking == "dynamic" and self.objective == "denoising":
            raise ValueError(
                "examples.masking=dynamic: denoising writes its noise into the shards; use static"
            )
        return self
