"""The `evaluate` section: what to probe a model with, and how.

Only the config models live here (`EvaluateConfig`, `IntrinsicConfig`, `PromptConfig`; the
decoding settings, `GenerationSettings`, are in `training/scoring/config.py`), so that a recipe
validates without importing torch, transformers or Prefect. The code they configure is in
`intrinsic.py`, `prompting.py` and `stage.py`, which re-export them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from training.scoring.config import GenerationSettings


def _default_decodings() -> list[GenerationSettings]:
    return [
        GenerationSettings(strategy="greedy", max_new_tokens=24),
        GenerationSettings(strategy="sample", temperature=0.8, max_new_tokens=24, seed=0),
        GenerationSettings(strategy="sample", top_k=20, max_new_tokens=24, seed=0),
        GenerationSettings(strategy="sample", top_p=0.9, max_new_tokens=24, seed=0),
    ]


class IntrinsicConfig(BaseModel):
    """What to probe a pretrained model with."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    heldout_split: str = Field("validation", description="Examples split for held-out metrics.")
    heldout_max_samples: int = Field(512, ge=1, description="Held-out examples evaluated.")
    batch_size: int = Field(32, ge=1, description="Examples per forward pass.")
    fill_mask: list[str] = Field(
        default_factory=lambda: ["The [MASK] sat on the mat."],
        description="Masked-LM probes; [MASK] stands for the tokenizer's mask token.",
    )
    top_k: int = Field(5, ge=1, description="Fillers shown per fill-mask probe.")
    prompts: list[str] = Field(
        default_factory=lambda: ["The"],
        description="Generation prompts (GPT: continuations; T5: text-to-text inputs).",
    )
    decodings: list[GenerationSettings] = Field(
        default_factory=_default_decodings, description="Decoding settings, each run per prompt."
    )


class PromptConfig(BaseModel):
    """How a classification example becomes a prompt, and how labels are scored."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    template: str = Field(
        "{text}\nLabel:",
        description="One example's prompt; {text} and (pairs) {text_pair} are filled in.",
    )
    verbalizers: dict[str, str] = Field(
        description="Label name -> the text scored after the prompt, e.g. "
        "{positive: ' great', negative: ' terrible'}; appended as is, so give it its "
        "leading space."
    )
    k_shot: int = Field(0, ge=0, description="Demonstrations per query (0 = zero-shot).")
    seed: int = Field(0, description="Seeds the choice of demonstrations.")
    separator: str = Field("\n\n", description="Between demonstrations and the query.")
    normalize: Literal["sum", "mean"] = Field(
        "sum",
        description="Label score: summed log-probability of the verbalizer's tokens, or "
        "their mean (length-normalised, for verbalizers of different lengths).",
    )
    batch_size: int = Field(16, ge=1, description="Prompt-label pairs per forward pass.")


class EvaluateConfig(BaseModel):
    """The `evaluate` section: intrinsic probes, and prompting on the task's test split."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    intrinsic: IntrinsicConfig = Field(default_factory=IntrinsicConfig)
    prompting: PromptConfig | None = Field(
        None,
        description="Zero/few-shot classification of the task by prompting (GPT, T5). A "
        "sentence-pair regression task (STS) is scored by embedding cosine instead.",
    )
    split: str = Field("test", description="Task split scored by prompting.")
    max_examples: int | None = Field(
        None, ge=1, description="Cap on the prompted examples (scoring is one pass per label)."
    )
