"""Extractive question answering (SQuAD v2 style): windows over the context, and answers back.

Here: `featurize_question_answering` (question + context windows of `max_length` tokens sharing
`stride` context tokens, start/end token positions of the first gold answer in each window,
or the null position when the window does not hold the whole answer or there is none) and
`postprocess_qa` (the n-best start/end logits of every window of an example, spans of at most
`max_answer_tokens`, mapped back to the context through character offsets; "" when the null
score wins by more than `null_threshold`). Not here: the SQuAD metric
(`training/scoring/metrics/metrics.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from tasks.common.schema import ANSWER_STARTS, ANSWER_TEXTS, CONTEXT, QUESTION, require_columns
from training.finetune.features.base import (
    Column,
    FeatureConfig,
    FeatureError,
    Features,
    Windows,
    apply_policy,
    check_window_room,
    encode_windows,
    example_ids,
    kept_features,
    log_windows,
    strings,
)


class AnswerConfig(BaseModel):
    """How start/end logits become answer strings."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    n_best: int = Field(20, ge=1, description="Start and end candidates per window.")
    max_answer_tokens: int = Field(30, ge=1, description="Longest answer span, in tokens.")
    null_threshold: float = Field(
        0.0,
        description='Predict "" when the null score exceeds the best span score by more than '
        "this (SQuAD v2; tune on validation).",
    )
    allow_unanswerable: bool = Field(
        True, description="SQuAD v2; False (v1) always answers with the best span."
    )


@dataclass(frozen=True)
class AnswerPrediction:
    """One example's answer: the text ("" = unanswerable) and the scores that decided it."""

    text: str
    score: float  # best span's start + end logit (-inf: no valid span)
    null_score: float  # lowest start + end logit at the null position over the windows


def _answers(table: pa.Table, ids: list[str], contexts: list[str]) -> list[tuple[int, int] | None]:
    """The first gold answer of each example as a character span, checked against its context."""
    texts = table.column(ANSWER_TEXTS).to_pylist()
    starts = table.column(ANSWER_STARTS).to_pylist()
    spans: list[tuple[int, int] | None] = []
    for example_id, context, answers, offsets in zip(ids, contexts, texts, starts, strict=True):
        if len(answers) != len(offsets):
            raise FeatureError(
                f"example {example_id!r}: {len(answers)} {ANSWER_TEXTS!r} but "
                f"{len(offsets)} {ANSWER_STARTS!r}"
            )
        for text, start in zip(answers, offsets, strict=True):
            if context[start : start + len(text)] != text:
                raise FeatureError(
                    f"example {example_id!r}: {ANSWER_STARTS!r} {start} does not point at "
                    f"{ANSWER_TEXTS!r} {text!r} in the context"
                )
        spans.append((offsets[0], offsets[0] + len(answers[0])) if answers else None)
    return spans


def _positions(offsets: np.ndarray, span: tuple[int, int] | None, null: int) -> tuple[int, int]:
    """Start and end token of `span` in a window, or (null, null) when it is not all inside."""
    context = np.flatnonzero(offsets[:, 0] >= 0)
    if span is None or not len(context):
        return null, null
    start_char, end_char = span
    if offsets[context[0], 0] > start_char or offsets[context[-1], 1] < end_char:
        return null, null
    # last context token starting at or before the answer; first one ending at or after it
    start = context[np.searchsorted(offsets[context, 0], start_char, side="right") - 1]
    end = context[np.searchsorted(offsets[context, 1], end_char, side="left")]
    return int(start), int(end)


def _null_index(row: Sequence[int], cls_id: int | None) -> int:
    """The "no answer" position: the CLS token where there is one, else position 0."""
    return list(row).index(cls_id) if cls_id is not None and cls_id in row else 0


def _context_offsets(windows: Windows, w: int, cls_id: int | None) -> tuple[np.ndarray, int]:
    """Window `w`'s (T, 2) character spans in the context (-1 elsewhere) and its null position."""
    assert windows.offsets is not None  # QA windows are encoded with offsets
    span = np.asarray(windows.offsets[w], dtype=np.int64).reshape(-1, 2)
    in_context = np.asarray([s == 1 for s in windows.sequence_ids[w]], dtype=bool)
    span[~in_context] = -1
    return span, _null_index(windows.rows["input_ids"][w], cls_id)


def featurize_question_answering(
    table: pa.Table, tokenizer: PreTrainedTokenizerBase, cfg: FeatureConfig
) -> Features:
    """Features of a QA table: one per window of `question` + a slice of `context`.

    Every window repeats the whole question (leading spaces dropped) and holds up to
    `cfg.max_length` tokens, sharing `cfg.stride` context tokens with the previous window.
    `start_positions`/`end_positions` mark the first gold answer where the window holds all of
    it, else the null position (the CLS token, or position 0 for vocabularies without one),
    also used for unanswerable questions. `Features.offsets` keeps each token's character span
    in the context (-1 for question and special tokens) for `postprocess_qa`.
    """
    require_columns(table, QUESTION, CONTEXT, ANSWER_TEXTS, ANSWER_STARTS)
    ids = example_ids(table)
    questions = [q.lstrip() for q in strings(table, QUESTION)]
    contexts = strings(table, CONTEXT)
    spans = _answers(table, ids, contexts)
    lengths = tokenizer(questions, contexts, add_special_tokens=False)
    kept = [row.count(0) for row in (lengths.sequence_ids(i) for i in range(len(ids)))]
    cut = [len(lengths["input_ids"][i]) - kept[i] for i in range(len(ids))]
    check_window_room(tokenizer, kept, cut, ids, cfg, QUESTION)
    windows = encode_windows(tokenizer, questions, contexts, "only_second", cfg, offsets=True)
    keep = apply_policy(windows, ids, cfg)
    offsets, nulls, starts, ends = [], [], [], []
    for w in np.flatnonzero(keep):
        span, null = _context_offsets(windows, int(w), tokenizer.cls_token_id)
        start, end = _positions(span, spans[windows.sample[w]], null)
        offsets.append(span)
        nulls.append(null)
        starts.append(start)
        ends.append(end)
    positions: dict[str, Column] = {
        "start_positions": np.asarray(starts, dtype=np.int64),
        "end_positions": np.asarray(ends, dtype=np.int64),
    }
    features = replace(
        kept_features(windows, keep, len(ids), positions),
        offsets=offsets,
        null_index=np.asarray(nulls, dtype=np.int64),
    )
    log_windows("question_answering", features)
    return features


def _best_span(
    start: np.ndarray, end: np.ndarray, offsets: np.ndarray, cfg: AnswerConfig
) -> tuple[float, int, int]:
    """The best (score, start, end) span of one window among its n-best starts and ends."""
    context = offsets[:, 0] >= 0
    if not context.any():
        return -np.inf, -1, -1
    masked_start = np.where(context, start, -np.inf)
    masked_end = np.where(context, end, -np.inf)
    top_start = np.argsort(-masked_start, kind="stable")[: cfg.n_best]
    top_end = np.argsort(-masked_end, kind="stable")[: cfg.n_best]
    scores = masked_start[top_start, None] + masked_end[None, top_end]  # (n_best, n_best)
    length = top_end[None, :] - top_start[:, None] + 1
    scores = np.where((length >= 1) & (length <= cfg.max_answer_tokens), scores, -np.inf)
    i, j = np.unravel_index(int(np.argmax(scores)), scores.shape)
    return float(scores[i, j]), int(top_start[i]), int(top_end[j])


def postprocess_qa(
    table: pa.Table,
    features: Features,
    start_logits: Sequence[np.ndarray] | np.ndarray,
    end_logits: Sequence[np.ndarray] | np.ndarray,
    cfg: AnswerConfig,
) -> list[AnswerPrediction]:
    """Answer strings for every example of `table` from its windows' start/end logits.

    The best span over all windows of an example (start + end logit, start <= end, at most
    `cfg.max_answer_tokens` tokens, inside the context) is cut from the context by the tokens'
    character offsets and stripped of surrounding spaces. Its score is compared with the null
    score (start + end logit at the null position, the lowest over the windows, as the
    SQuAD v2 reference post-processing does): "" when null - best > `cfg.null_threshold`.

    Args:
        table: The QA table the features were made from (for the contexts).
        features: From `featurize_question_answering`.
        start_logits: Per feature a (T,) array, or one right-padded (F, T) array.
        end_logits: The same for the end position.
        cfg: n-best, answer length, null threshold.
    """
    if features.offsets is None or features.null_index is None:
        raise ValueError("features are not question-answering features")
    if not len(start_logits) == len(end_logits) == len(features):
        raise ValueError(f"logits for {len(start_logits)} windows, features {len(features)}")
    contexts = strings(table, CONTEXT)
    best = [(-np.inf, "")] * features.num_examples
    null = np.full(features.num_examples, np.inf)
    for f, offsets in enumerate(features.offsets):
        example, n = int(features.example_index[f]), int(features.null_index[f])
        start = np.asarray(start_logits[f], dtype=np.float64)[: len(offsets)]
        end = np.asarray(end_logits[f], dtype=np.float64)[: len(offsets)]
        null[example] = min(null[example], start[n] + end[n])
        score, i, j = _best_span(start, end, offsets, cfg)
        if score > best[example][0]:
            text = contexts[example][offsets[i, 0] : offsets[j, 1]].strip()
            best[example] = (score, text)
    return [
        _decide(text, score, float(n), cfg) for (score, text), n in zip(best, null, strict=True)
    ]


def _decide(text: str, score: float, null_score: float, cfg: AnswerConfig) -> AnswerPrediction:
    """The span's text, or "" when the null score beats it by more than the threshold."""
    unanswerable = cfg.allow_unanswerable and null_score - score > cfg.null_threshold
    return AnswerPrediction("" if unanswerable else text, score, null_score)
