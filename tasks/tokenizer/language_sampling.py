"""Temperature-based language sampling (XLM-R): rebalance a multilingual corpus by language.

XLM-R (Conneau et al. 2020, https://arxiv.org/abs/1911.02116, section 3.1) draws language i
with probability q_i = p_i^alpha / sum_j p_j^alpha, where p_i is the language's share of the
corpus. alpha = 1 keeps the natural mix, alpha = 0 is uniform over languages, and XLM-R's 0.3
(temperature 1/alpha ~ 3.3) lifts low-resource languages without drowning the large ones.

Here: the config section, the q formula, and a seeded plan of which rows realise q within a
budget (rows may repeat, so a language whose share grows is up-sampled). Pure: no files, clock
or logging. The tokenizer stage (tasks/tokenizer/stage.py) reads the shards and streams the
planned rows to the trainer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tasks.common import schema

Unit = Literal["characters", "documents"]


class LanguageSamplingConfig(BaseModel):
    """XLM-R-style sampling by language: q_i proportional to p_i^alpha (temperature 1/alpha)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    alpha: float = Field(
        0.3,
        description="Exponent on each language's natural share, 0 to 1: 1 keeps the natural "
        "mix, 0 is uniform, XLM-R uses 0.3 (temperature = 1/alpha).",
    )
    languages: dict[str, str] = Field(
        default_factory=dict,
        description="Source name -> language code; a source not listed is its own language.",
    )
    unit: Unit = Field(
        "characters", description="What p_i, q_i and the budget count: characters or documents."
    )
    sample_characters: int | None = Field(
        None,
        ge=1,
        description="unit characters: characters in the sampled mix; None: the corpus's own "
        "(unit documents: the tokenizer's `sample_documents` is the budget).",
    )
    seed: int = Field(0, ge=0, description="Seed of the per-language document draws.")

    @field_validator("alpha")
    @classmethod
    def _alpha_in_range(cls, alpha: float) -> float:
        if not 0.0 <= alpha <= 1.0:  # NaN fails too
            raise ValueError(
                f"alpha must be between 0 (uniform over languages) and 1 (the natural mix); "
                f"XLM-R uses 0.3; got {alpha}"
            )
        return alpha

    @field_validator("languages")
    @classmethod
    def _names_not_empty(cls, languages: dict[str, str]) -> dict[str, str]:
        empty = sorted(k for k, v in languages.items() if not k.strip() or not v.strip())
        if empty:
            raise ValueError(f"source names and language codes must not be empty: {empty}")
        return languages

    @model_validator(mode="after")
    def _budget_in_unit(self) -> LanguageSamplingConfig:
        if self.unit == "documents" and self.sample_characters is not None:
            raise ValueError(
                "sample_characters is the budget of unit characters; with unit documents "
                "the budget is the tokenizer's sample_documents"
            )
        return self


@dataclass(frozen=True)
class LanguageShare:
    """One language: its sources, its natural size and share p, target q, and what was drawn.

    Units are those of the config (`characters` or `documents`).
    """

    sources: tuple[str, ...]
    documents: int
    units: int
    natural_share: float
    target_share: float
    sampled_documents: int
    sampled_units: int
    realised_share: float


@dataclass(frozen=True)
class LanguageSample:
    """The plan: row numbers into the input table (sorted, repeats allowed) and per language."""

    rows: np.ndarray
    alpha: float
    unit: Unit
    budget_units: int
    languages: dict[str, LanguageShare]

    def report(self) -> dict[str, Any]:
        """JSON-able summary (for a manifest): alpha, unit, budget and each language's figures."""
        return {
            "alpha": self.alpha,
            "unit": self.unit,
            "budget_units": self.budget_units,
            "languages": {
                name: {**share.__dict__, "sources": list(share.sources)}
                for name, share in self.languages.items()
            },
        }


def temperature_shares(counts: Mapping[str, float], alpha: float) -> dict[str, float]:
    """Return q_i = p_i^alpha / sum_j p_j^alpha, with p_i = counts_i / sum(counts).

    A language with no data keeps q = 0 (even at alpha = 0: there is nothing to draw).

    Raises:
        ValueError: every count is zero.
    """
    total = float(sum(counts.values()))
    if total <= 0:
        raise ValueError("no data to sample from: every language is empty")
    weights = {k: (v / total) ** alpha if v > 0 else 0.0 for k, v in counts.items()}
    norm = sum(weights.values())
    return {k: w / norm for k, w in weights.items()}


def sample_languages(
    table: pa.Table, cfg: LanguageSamplingConfig, budget_units: int | None = None
) -> LanguageSample:
    """Plan which rows of `table` (a corpus with `source`, and `text` for characters) to train on.

    Each language gets q_i * budget units (`budget_units` None: the corpus's own size). A
    language drawn beyond its size repeats all its documents as often as fits, then a seeded
    random part; one drawn below it takes a seeded random subset. The draws of a language are
    seeded by `cfg.seed` and its name, so adding a language does not change the others'.

    Raises:
        ValueError: `cfg.languages` names a source the corpus lacks, or the corpus is empty.
    """
    need = [schema.SOURCE, schema.TEXT] if cfg.unit == "characters" else [schema.SOURCE]
    schema.require_columns(table, *need)
    if table.num_rows == 0:
        raise ValueError("language_sampling: the corpus has no documents")
    codes, names, sources = _language_codes(table.column(schema.SOURCE), cfg.languages)
    sizes = (
        pc.utf8_length(table.column(schema.TEXT)).to_numpy().astype(np.int64)
        if cfg.unit == "characters"
        else np.ones(table.num_rows, dtype=np.int64)
    )
    documents = np.bincount(codes, minlength=len(names))
    units = np.bincount(codes, weights=sizes, minlength=len(names)).astype(np.int64)
    budget = int(units.sum()) if budget_units is None else budget_units
    q = temperature_shares(dict(zip(names, units.tolist(), strict=True)), cfg.alpha)
    targets = _targets([q[n] for n in names], budget, integral=cfg.unit == "documents")
    order = np.argsort(codes, kind="stable")  # rows grouped by language, in corpus order
    starts = np.concatenate([[0], np.cumsum(documents)])
    picked = []
    for i, name in enumerate(names):
        rows = order[starts[i] : starts[i + 1]]
        rng = np.random.default_rng([cfg.seed, zlib.crc32(name.encode())])
        picked.append(rows[_draw(sizes[rows], targets[i], rng)])
    sampled_units = [int(sizes[p].sum()) for p in picked]
    drawn = max(sum(sampled_units), 1)
    shares = {
        name: LanguageShare(
            sources=tuple(sources[name]),
            documents=int(documents[i]),
            units=int(units[i]),
            natural_share=float(units[i] / units.sum()) if units.sum() else 0.0,
            target_share=q[name],
            sampled_documents=len(picked[i]),
            sampled_units=sampled_units[i],
            realised_share=sampled_units[i] / drawn,
        )
        for i, name in enumerate(names)
    }
    return LanguageSample(np.sort(np.concatenate(picked)), cfg.alpha, cfg.unit, budget, shares)


def _language_codes(
    column: pa.ChunkedArray, languages: Mapping[str, str]
) -> tuple[np.ndarray, list[str], dict[str, list[str]]]:
    """Each row's language number, the language names (sorted) and each language's sources."""
    present = sorted(pc.unique(column).to_pylist())
    unknown = sorted(set(languages) - set(present))
    if unknown:
        raise ValueError(
            f"language_sampling.languages names source(s) {unknown} that the corpus does not "
            f"have; its sources are {present}"
        )
    language_of = [languages.get(s, s) for s in present]
    names = sorted(set(language_of))
    sources = {
        n: [s for s, lang in zip(present, language_of, strict=True) if lang == n] for n in names
    }
    to_language = np.array([names.index(lang) for lang in language_of], dtype=np.int64)
    source_codes = pc.index_in(column, value_set=pa.array(present, column.type)).to_numpy()
    return to_language[source_codes.astype(np.int64)], names, sources


def _targets(q: list[float], budget: int, *, integral: bool) -> list[float]:
    """Units per language: q_i * budget; whole documents (largest remainder) when `integral`."""
    exact = [share * budget for share in q]
    if not integral:
        return exact
    floors = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(q)), key=lambda i: floors[i] - exact[i])
    for i in by_remainder[: budget - sum(floors)]:
        floors[i] += 1
    return [float(x) for x in floors]


def _draw(sizes: np.ndarray, target: float, rng: np.random.Generator) -> np.ndarray:
    """Local indices (repeats allowed) whose sizes sum as near `target` as whole documents allow.

    Every document `target // total` times, then the prefix of a seeded permutation whose
    running total is nearest the rest.
    """
    total = int(sizes.sum())
    if total == 0 or target <= 0:
        return np.zeros(0, dtype=np.int64)
    copies, rest = divmod(target, total)
    perm = rng.permutation(len(sizes))
    running = np.cumsum(sizes[perm])
    k = int(np.searchsorted(running, rest))  # running[k - 1] < rest <= running[k]
    below = running[k - 1] if k > 0 else 0
    above = running[k] if k < len(running) else math.inf
    take = k if rest - below <= above - rest else k + 1
    return np.concatenate([np.tile(np.arange(len(sizes)), int(copies)), perm[:take]])
