"""Downstream tables to model inputs, per task type, and the collators that batch them.

Here: `featurize` (dispatch by task type), sequence classification and regression (single texts
or pairs, long inputs as overlapping windows), seq2seq (T5 prefix + source, target labels) and
causal-LM fine-tuning (prompt + response, loss on the response only), and `Collator` /
`make_collator` (dynamic padding). Token classification lives in
`training/finetune/features/tokens.py`, question answering in `training/finetune/features/qa.py`,
the shared pieces (`FeatureConfig`, `Features`, windows, aggregation) in
`training/finetune/features/base.py`; they are re-exported here. Tables follow
`tasks.common.schema.downstream_schema`. Not here: reading files, models, metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from transformers import PreTrainedTokenizerBase

from tasks.common.schema import (
    DOWNSTREAM_TASK_TYPES,
    LABEL,
    PROMPT,
    RESPONSE,
    TARGET,
    TEXT,
    TEXT_PAIR,
    require_columns,
)
from training.finetune.features.base import (
    IGNORE_INDEX,
    FeatureConfig,
    FeatureError,
    Features,
    Windows,
    aggregate_windows,
    apply_policy,
    check_window_room,
    encode_windows,
    example_ids,
    int_rows,
    kept_features,
    log_windows,
    strings,
)
from training.finetune.features.qa import (
    AnswerConfig,
    AnswerPrediction,
    featurize_question_answering,
    postprocess_qa,
)
from training.finetune.features.tokens import featurize_token_classification, word_predictions
from training.models.tokens import causal_bos, pad_id

__all__ = [
    "IGNORE_INDEX",
    "AnswerConfig",
    "AnswerPrediction",
    "Collator",
    "FeatureConfig",
    "FeatureError",
    "Features",
    "aggregate_windows",
    "causal_bos",
    "featurize",
    "featurize_causal_lm",
    "featurize_classification",
    "featurize_question_answering",
    "featurize_seq2seq",
    "featurize_token_classification",
    "make_collator",
    "pad_id",
    "postprocess_qa",
    "word_predictions",
]


def _lengths(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> np.ndarray:
    """Tokens of each text without specials."""
    if not texts:
        return np.zeros(0, np.int64)
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return np.asarray([len(row) for row in ids], dtype=np.int64)


def _pair_windows(
    tokenizer: PreTrainedTokenizerBase,
    first: list[str],
    second: list[str],
    ids: list[str],
    cfg: FeatureConfig,
) -> Windows:
    """Window text pairs over the longer text of each pair, keeping the shorter one whole."""
    len_a, len_b = _lengths(tokenizer, first), _lengths(tokenizer, second)
    cut_first = len_a > len_b
    kept, cut = np.where(cut_first, len_b, len_a), np.where(cut_first, len_a, len_b)
    check_window_room(tokenizer, kept.tolist(), cut.tolist(), ids, cfg, "shorter text")
    parts = []
    sides: tuple[tuple[np.ndarray, Literal["only_first", "only_second"]], ...] = (
        (cut_first, "only_first"),
        (~cut_first, "only_second"),
    )
    for mask, which in sides:
        rows = np.flatnonzero(mask)
        part = encode_windows(
            tokenizer, [first[i] for i in rows], [second[i] for i in rows], which, cfg
        )
        parts.append((rows[part.sample], part))
    sample = np.concatenate([s for s, _ in parts])
    order = np.argsort(sample, kind="stable")  # table order; windows of one example in order
    keys = next((p.rows.keys() for _, p in parts if p.rows), ())
    merged = {key: [row for _, p in parts for row in p.rows.get(key, [])] for key in keys}
    seq_ids = [s for _, p in parts for s in p.sequence_ids]
    return Windows(
        rows={key: [merged[key][i] for i in order] for key in keys},
        sample=sample[order],
        sequence_ids=[seq_ids[i] for i in order],
        offsets=None,
    )


def _check_labels(labels: np.ndarray, ids: list[str], num_labels: int | None) -> None:
    if num_labels is None or labels.dtype.kind == "f":
        return
    bad = np.flatnonzero((labels < 0) | (labels >= num_labels))
    if len(bad):
        raise FeatureError(
            f"column {LABEL!r}: example {ids[bad[0]]!r} has label {labels[bad[0]]}, outside "
            f"the {num_labels} labels (0..{num_labels - 1})"
        )


def featurize_classification(
    table: pa.Table,
    tokenizer: PreTrainedTokenizerBase,
    cfg: FeatureConfig,
    num_labels: int | None = None,
) -> Features:
    """Features of a classification or regression table (`text`, optional `text_pair`, `label`).

    A text longer than `cfg.max_length` becomes overlapping windows (`cfg.truncation`), each a
    feature carrying the example's label; `aggregate_windows` merges their predictions. For a
    pair, the longer text is windowed and the shorter one repeated whole in every window.
    Integer labels become int64 (checked against `num_labels` when given), float labels
    (regression) float32.
    """
    require_columns(table, TEXT, LABEL)
    ids = example_ids(table)
    first = strings(table, TEXT)
    if TEXT_PAIR in table.column_names:
        windows = _pair_windows(tokenizer, first, strings(table, TEXT_PAIR), ids, cfg)
    else:
        room = cfg.max_length - tokenizer.num_special_tokens_to_add(pair=False)
        if room <= cfg.stride:
            raise FeatureError(f"max_length {cfg.max_length} leaves {room} tokens per window")
        windows = encode_windows(tokenizer, first, None, "only_first", cfg)
    labels = table.column(LABEL).to_numpy()
    labels = labels.astype(np.float32 if labels.dtype.kind == "f" else np.int64)
    _check_labels(labels, ids, num_labels)
    keep = apply_policy(windows, ids, cfg)
    features = kept_features(windows, keep, len(ids), {"labels": labels[windows.sample[keep]]})
    log_windows("classification", features)
    return features


def _first_windows(
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    ids: list[str],
    cfg: FeatureConfig,
    max_length: int,
    column: str,
) -> tuple[dict[str, list[np.ndarray]], np.ndarray]:
    """Each text cut to `max_length` tokens (specials kept); which ones were cut."""
    room = max_length - tokenizer.num_special_tokens_to_add(pair=False)
    if room <= 0:
        raise FeatureError(f"a max length of {max_length} leaves no room for {column!r} tokens")
    policy = "truncate" if cfg.truncation == "window" else cfg.truncation
    cut = cfg.model_copy(update={"max_length": max_length, "stride": 0, "truncation": policy})
    windows = encode_windows(tokenizer, texts, None, "only_first", cut)
    try:
        keep = apply_policy(windows, ids, cut)
    except FeatureError as err:
        raise FeatureError(f"column {column!r}: {err}") from err
    cut_rows = np.bincount(windows.sample, minlength=len(texts)) > 1
    return {key: int_rows(rows, keep) for key, rows in windows.rows.items()}, cut_rows


def featurize_seq2seq(
    table: pa.Table,
    tokenizer: PreTrainedTokenizerBase,
    cfg: FeatureConfig,
    source_prefix: str = "",
) -> Features:
    """Features of a seq2seq table: `source_prefix + text` -> input_ids, `target` -> labels.

    Sources are cut to `cfg.max_length` and targets to `cfg.max_target_length` tokens (eos
    kept; `truncation: error` refuses instead). Labels are the target ids; the collator pads
    them with -100, so padding never counts in the loss, and T5 builds its decoder inputs from
    them (shifted right behind the decoder start token).
    """
    require_columns(table, TEXT, TARGET)
    ids = example_ids(table)
    sources = [source_prefix + text for text in strings(table, TEXT)]
    inputs, cut_src = _first_windows(tokenizer, sources, ids, cfg, cfg.max_length, TEXT)
    targets, cut_tgt = _first_windows(
        tokenizer, strings(table, TARGET), ids, cfg, cfg.max_target_length, TARGET
    )
    pad = tokenizer.pad_token_id
    labels = [
        row if pad is None else np.where(row == pad, IGNORE_INDEX, row)
        for row in targets["input_ids"]
    ]
    columns: dict[str, list[np.ndarray] | np.ndarray] = {**inputs, "labels": labels}
    index = np.arange(len(ids), dtype=np.int64)
    features = Features(columns, index, len(ids), 0, int(np.sum(cut_src | cut_tgt)))
    log_windows("seq2seq", features)
    return features


def _fit_causal(
    prompt: list[int], response: list[int], room: int
) -> tuple[list[int], list[int], bool]:
    """Cut prompt + response to `room` tokens: the prompt loses its start, the response its end.

    The prompt keeps at least half the room (or all of itself) so that the response still has
    its context; the response gets the rest.
    """
    if len(prompt) + len(response) <= room:
        return prompt, response, False
    keep = min(len(prompt), max(room - len(response), room // 2))
    return prompt[len(prompt) - keep :], response[: room - keep], True


def featurize_causal_lm(
    table: pa.Table, tokenizer: PreTrainedTokenizerBase, cfg: FeatureConfig
) -> Features:
    """Features of a prompt/response table: labels are -100 on the prompt (loss on the response).

    input_ids = [bos] + prompt + response + [eos] (bos only where the vocabulary has one of its
    own, `causal_bos`; eos when `cfg.add_eos`). Prompt and response are tokenized separately,
    so the boundary is exact. A pair longer than `cfg.max_length` loses the start of its prompt
    and then the end of its response (`_fit_causal`), or is refused (`truncation: error`).
    """
    require_columns(table, PROMPT, RESPONSE)
    ids = example_ids(table)
    bos = causal_bos(tokenizer)
    eos = [tokenizer.eos_token_id] if cfg.add_eos else []
    if None in eos:
        raise FeatureError("add_eos is set but the tokenizer has no eos token")
    prompts = tokenizer(strings(table, PROMPT), add_special_tokens=False)["input_ids"]
    responses = tokenizer(strings(table, RESPONSE), add_special_tokens=False)["input_ids"]
    rows, labels, truncated = [], [], 0
    for example_id, prompt, response in zip(ids, prompts, responses, strict=True):
        prompt, response, cut = _fit_causal(prompt, response + eos, cfg.max_length - len(bos))
        if cut and cfg.truncation == "error":
            raise FeatureError(f"example {example_id!r} is longer than {cfg.max_length} tokens")
        truncated += cut
        rows.append(np.asarray(bos + prompt + response, dtype=np.int64))
        labels.append(np.asarray([IGNORE_INDEX] * (len(bos) + len(prompt)) + response, np.int64))
    inputs: dict[str, list[np.ndarray] | np.ndarray] = {
        "input_ids": rows,
        "attention_mask": [np.ones_like(row) for row in rows],
        "labels": labels,
    }
    features = Features(inputs, np.arange(len(ids), dtype=np.int64), len(ids), 0, truncated)
    log_windows("causal_lm", features)
    return features


def featurize(
    table: pa.Table,
    tokenizer: PreTrainedTokenizerBase,
    task_type: str,
    cfg: FeatureConfig,
    labels: Sequence[str] = (),
    source_prefix: str = "",
) -> Features:
    """Features of a downstream table of `task_type` (the label names for the label checks)."""
    if task_type in ("classification", "regression"):
        return featurize_classification(table, tokenizer, cfg, len(labels) or None)
    if task_type == "token_classification":
        return featurize_token_classification(table, tokenizer, cfg, labels)
    if task_type == "question_answering":
        return featurize_question_answering(table, tokenizer, cfg)
    if task_type == "seq2seq":
        return featurize_seq2seq(table, tokenizer, cfg, source_prefix)
    if task_type == "causal_lm":
        return featurize_causal_lm(table, tokenizer, cfg)
    raise ValueError(f"unknown task type {task_type!r}; one of {DOWNSTREAM_TASK_TYPES}")


class Collator:
    """Pad a list of feature rows to the longest row of the batch and stack them as tensors.

    `input_ids` pad with the tokenizer's pad id, sequence `labels` with -100 (ignored by the
    loss), masks and token types with 0; scalar columns (class labels, QA positions) stack.
    """

    PAD_VALUES: Mapping[str, int] = {
        "attention_mask": 0,
        "token_type_ids": 0,
        "labels": IGNORE_INDEX,
    }

    def __init__(
        self,
        pad_token_id: int,
        padding_side: Literal["right", "left"] = "right",
        pad_to_multiple_of: int | None = None,
    ) -> None:
        """Pad with `pad_token_id` on `padding_side`, lengths rounded up to a multiple."""
        self.pad_values = {**self.PAD_VALUES, "input_ids": pad_token_id}
        self.padding_side = padding_side
        self.multiple = pad_to_multiple_of or 1

    def _pad(self, rows: Sequence[np.ndarray], value: int) -> np.ndarray:
        width = max(len(row) for row in rows)
        width = -(-width // self.multiple) * self.multiple
        out = np.full((len(rows), width), value, dtype=rows[0].dtype)  # (B, T)
        for i, row in enumerate(rows):
            if self.padding_side == "right":
                out[i, : len(row)] = row
            else:
                out[i, width - len(row) :] = row
        return out

    def __call__(self, rows: Sequence[Mapping[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """Collate `rows` (dicts as given by `Features[i]`) into a batch of tensors."""
        if not rows:
            raise ValueError("cannot collate an empty batch")
        batch = {}
        for key in rows[0]:
            values = [np.asarray(row[key]) for row in rows]
            if values[0].ndim == 0:
                batch[key] = torch.from_numpy(np.stack(values))
            elif key in self.pad_values:
                batch[key] = torch.from_numpy(self._pad(values, self.pad_values[key]))
            else:
                raise ValueError(f"no padding value for sequence column {key!r}")
        return batch


def make_collator(
    task_type: str, tokenizer: PreTrainedTokenizerBase, pad_to_multiple_of: int | None = None
) -> Collator:
    """The training collator of `task_type`: right padding with the tokenizer's pad id.

    Right padding suits training and scoring for every family (decoder-only models number
    positions from 0 and padded labels are -100); generation pads on the left
    (`training/scoring/generation.py`).
    """
    if task_type not in DOWNSTREAM_TASK_TYPES:
        raise ValueError(f"unknown task type {task_type!r}; one of {DOWNSTREAM_TASK_TYPES}")
    return Collator(pad_id(tokenizer), "right", pad_to_multiple_of)
