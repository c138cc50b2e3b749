"""How to decode text (`GenerationSettings`): used by fine-tuning's generation tasks and evaluation.

Only the config model lives here, so that a recipe validates without importing torch or
transformers; `generation.py` decodes with it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class GenerationSettings(BaseModel):
    """How to decode: greedy (or beam search) or sampling, and how much."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    strategy: Literal["greedy", "sample"] = Field(
        "greedy",
        description="greedy: the most likely token (beam search if num_beams > 1); "
        "sample: draw from the temperature / top-k / top-p distribution.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling: logits are divided by it.")
    top_k: int = Field(0, ge=0, description="Sampling: keep the k likeliest tokens; 0 is off.")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Sampling: keep the smallest set with this probability."
    )
    max_new_tokens: int = Field(32, ge=1, description="Tokens generated per prompt at most.")
    num_beams: int = Field(1, ge=1, description="Beams; 1 is no beam search.")
    seed: int = Field(0, description="Seeds sampling; the same prompts give the same texts.")
    batch_size: int = Field(16, ge=1, description="Prompts decoded together.")
