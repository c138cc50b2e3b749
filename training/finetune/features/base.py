"""What every featurizer shares: the config, the `Features` container, windowing, aggregation.

Here: `FeatureConfig` (the `finetune.features` section), `Features` (one row per window, ready
for a collator), `FeatureError`, the pad and bos conventions (`pad_id`, `causal_bos`, from
`training/models/tokens.py`),
`encode_windows` (a batch of texts or text pairs cut into overlapping windows by the fast
tokenizer), the long-input policy and `aggregate_windows` (per-window predictions back to one
per example). Not here: the task featurizers (`training/finetune/features/features.py`, `tokens.py`,
`qa.py`) and the collators (`training/finetune/features/features.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.common.schema import EXAMPLE_ID, require_columns

if TYPE_CHECKING:  # only annotations: the `finetune` section validates without transformers
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: Label value that torch's cross entropy (and every transformers head) ignores.
IGNORE_INDEX = -100

Column = list[np.ndarray] | np.ndarray  # ragged int64 rows, or one scalar per feature


class FeatureError(ValueError):
    """An example cannot become features; the message names the example id and the column."""


class FeatureConfig(BaseModel):
    """How downstream examples become model inputs (docs/tasks.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    max_length: int = Field(
        256, ge=8, description="Tokens per feature, specials included (seq2seq: the source)."
    )
    stride: int = Field(
        64,
        ge=0,
        description="Tokens shared by consecutive windows of a long input (QA: doc stride).",
    )
    truncation: Literal["window", "truncate", "error"] = Field(
        "window",
        description="Inputs longer than max_length: window (overlapping windows, each a "
        "feature), truncate (first window only, counted) or error. seq2seq and causal_lm "
        "cannot be windowed and truncate under window.",
    )
    aggregation: Literal["mean", "max"] = Field(
        "mean",
        description="Windows of one example -> one prediction: mean or element-wise max "
        "of the windows' logits.",
    )
    label_all_tokens: bool = Field(
        False,
        description="token_classification: label every piece of a word (B- becomes I- after "
        "the first) instead of the first piece only.",
    )
    max_target_length: int = Field(128, ge=1, description="seq2seq: tokens per target.")
    add_eos: bool = Field(
        True, description="causal_lm: end each response with eos so that generation stops."
    )

    @model_validator(mode="after")
    def _stride_leaves_room(self) -> FeatureConfig:
        if self.stride >= self.max_length // 2:
            raise ValueError(
                f"stride {self.stride} must be below half of max_length {self.max_length}, "
                "or windows would barely advance"
            )
        return self


@dataclass(frozen=True)
class Features:
    """Model inputs of one table: one row per feature (window), in table order.

    `inputs` holds ragged int64 rows (`input_ids`, `attention_mask`, sequence `labels`, ...)
    or one scalar per feature (`labels` of classification, QA `start_positions`); indexing a
    `Features` gives one row as a dict for the collator. `example_index[f]` is the table row
    feature `f` came from. Token classification also keeps `word_index` (the word whose first
    piece each token is, else -1) and `num_words`; QA keeps `offsets` ((T, 2) character spans
    into the context, -1 outside it) and `null_index` (the position scored as "no answer").
    """

    inputs: dict[str, Column]
    example_index: np.ndarray
    num_examples: int
    num_windowed: int = 0
    num_truncated: int = 0
    word_index: list[np.ndarray] | None = None
    num_words: np.ndarray | None = None
    offsets: list[np.ndarray] | None = None
    null_index: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.example_index)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {key: np.asarray(column[i]) for key, column in self.inputs.items()}


def strings(table: pa.Table, name: str) -> list[str]:
    """One string column as a Python list (the tokenizer's input)."""
    require_columns(table, name)
    return [str(value) for value in table.column(name).to_pylist()]


@dataclass(frozen=True)
class Windows:
    """A batch cut into windows: token rows, the example of each window, and sequence ids."""

    rows: dict[str, list[list[int]]]
    sample: np.ndarray  # (W,) example index of each window
    sequence_ids: list[list[int | None]]
    offsets: list[list[tuple[int, int]]] | None


def encode_windows(
    tokenizer: PreTrainedTokenizerBase,
    first: Sequence[str],
    second: Sequence[str] | None,
    which: Literal["only_first", "only_second"],
    cfg: FeatureConfig,
    offsets: bool = False,
    stride: int | None = None,
) -> Windows:
    """Tokenize (pairs of) texts, cutting the `which` sequence into overlapping windows.

    Each window holds at most `cfg.max_length` tokens, specials included, and shares `stride`
    tokens (default `cfg.stride`) with the previous one; the other sequence is repeated whole.
    The caller must have checked that the other sequence leaves room (`check_window_room`).
    """
    if not first:
        return Windows({}, np.zeros(0, np.int64), [], [] if offsets else None)
    enc = tokenizer(
        list(first),
        list(second) if second is not None else None,
        truncation=which if second is not None else True,
        max_length=cfg.max_length,
        stride=cfg.stride if stride is None else stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=offsets,
    )
    keys = [key for key in tokenizer.model_input_names if key in enc]
    return Windows(
        rows={key: enc[key] for key in keys},
        sample=np.asarray(enc["overflow_to_sample_mapping"], dtype=np.int64),
        sequence_ids=[enc.sequence_ids(i) for i in range(len(enc["input_ids"]))],
        offsets=enc["offset_mapping"] if offsets else None,
    )


def check_window_room(
    tokenizer: PreTrainedTokenizerBase,
    kept_lengths: Sequence[int],
    cut_lengths: Sequence[int],
    example_ids: Sequence[str],
    cfg: FeatureConfig,
    what: str,
) -> None:
    """Refuse examples too long to fit whose whole (uncut) part leaves no room to slide.

    Args:
        tokenizer: The fast tokenizer (for its number of special tokens).
        kept_lengths: Tokens of the sequence repeated in every window (0 for single texts).
        cut_lengths: Tokens of the sequence that is windowed.
        example_ids: For the message.
        cfg: `max_length` and `stride`.
        what: Names the kept column in the message, e.g. "question".

    Raises:
        FeatureError: naming the first such example.
    """
    pair = any(kept_lengths)
    specials = tokenizer.num_special_tokens_to_add(pair=pair)
    for kept, cut, example_id in zip(kept_lengths, cut_lengths, example_ids, strict=True):
        if kept + cut + specials <= cfg.max_length:
            continue  # fits: no window needed
        room = cfg.max_length - specials - kept
        if room <= cfg.stride:
            raise FeatureError(
                f"example {example_id!r}: its {what} takes {kept} of max_length "
                f"{cfg.max_length} tokens ({specials} specials), leaving {room} per window, "
                f"not more than stride {cfg.stride}; raise max_length or lower stride"
            )


def apply_policy(windows: Windows, example_ids: Sequence[str], cfg: FeatureConfig) -> np.ndarray:
    """Which windows to keep under `cfg.truncation`: all, or each example's first.

    Raises:
        FeatureError: `truncation: error` and some example needs more than one window.
    """
    counts = np.bincount(windows.sample, minlength=len(example_ids))
    long = np.flatnonzero(counts > 1)
    if cfg.truncation == "error" and len(long):
        named = [example_ids[i] for i in long[:5]]
        raise FeatureError(
            f"{len(long)} example(s) longer than max_length {cfg.max_length}, e.g. {named}; "
            "set truncation to window or truncate, or raise max_length"
        )
    if cfg.truncation == "window":
        return np.ones(len(windows.sample), dtype=bool)
    first = np.ones(len(windows.sample), dtype=bool)
    first[1:] = windows.sample[1:] != windows.sample[:-1]
    return first


def window_counts(sample: np.ndarray, kept: np.ndarray, num_examples: int) -> tuple[int, int]:
    """(examples split into several kept windows, examples whose extra windows were dropped)."""
    total = np.bincount(sample, minlength=num_examples)
    kept_counts = np.bincount(sample[kept], minlength=num_examples)
    return int(np.sum(kept_counts > 1)), int(np.sum(total > kept_counts))


def int_rows(rows: Sequence[Sequence[int]], keep: np.ndarray) -> list[np.ndarray]:
    """The kept rows as int64 arrays."""
    return [np.asarray(row, dtype=np.int64) for row, k in zip(rows, keep, strict=True) if k]


def kept_features(
    windows: Windows, keep: np.ndarray, num_examples: int, extra: dict[str, Column]
) -> Features:
    """Build the `Features` of the kept windows: their token rows, then the `extra` inputs.

    The counts of windowed and truncated examples come from `window_counts`.
    """
    inputs: dict[str, Column] = {key: int_rows(rows, keep) for key, rows in windows.rows.items()}
    windowed, truncated = window_counts(windows.sample, keep, num_examples)
    return Features(inputs | extra, windows.sample[keep], num_examples, windowed, truncated)


def example_ids(table: pa.Table) -> list[str]:
    """The `example_id` column (for messages)."""
    require_columns(table, EXAMPLE_ID)
    return strings(table, EXAMPLE_ID)


def log_windows(task: str, features: Features) -> None:
    """Report how many examples were windowed or truncated."""
    log.info(
        "%s: %d examples -> %d features; %d windowed, %d truncated",
        task,
        features.num_examples,
        len(features),
        features.num_windowed,
        features.num_truncated,
    )


def aggregate_windows(
    window_logits: np.ndarray,
    example_index: np.ndarray,
    num_examples: int,
    how: Literal["mean", "max"] = "mean",
) -> np.ndarray:
    """Combine per-window predictions into one per example.

    `mean` averages the windows' logits (every window votes equally; the default); `max` takes
    each class's largest logit over the windows (the strongest local evidence wins: suits labels
    decided by one passage of a long text). Regression outputs aggregate the same way.

    Args:
        window_logits: (F, C) or (F,) predictions, one row per feature.
        example_index: (F,) the example of each feature.
        num_examples: N, the table's rows.
        how: mean or max.

    Returns:
        (N, C) or (N,) float64 predictions, in table order.

    Raises:
        ValueError: some example has no window, or the lengths differ.
    """
    logits = np.asarray(window_logits, dtype=np.float64)
    index = np.asarray(example_index, dtype=np.int64)
    if len(logits) != len(index):
        raise ValueError(f"{len(logits)} window predictions for {len(index)} features")
    counts = np.bincount(index, minlength=num_examples)
    if len(counts) > num_examples or np.any(counts == 0):
        raise ValueError(f"example_index does not cover exactly {num_examples} examples")
    shape = (num_examples, *logits.shape[1:])
    if how == "max":
        out = np.full(shape, -np.inf)
        np.maximum.at(out, index, logits)
        return out
    out = np.zeros(shape)
    np.add.at(out, index, logits)
    return out / counts.reshape(-1, *([1] * (logits.ndim - 1)))
