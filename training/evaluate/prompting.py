"""Zero- and few-shot classification by prompting a language model, with no training.

Here: `PromptConfig` (a template, one verbalizer per label, k demonstrations drawn with a seed),
`build_prompts` (each query's prompt, its demonstrations taken from the train split, never the
query itself), `score_continuations` (the log-probability a causal LM, or T5's decoder, gives
each verbalizer after each prompt) and `classify_by_prompting`, which returns predicted label
indexes and per-label scores (softmax them for AUC). Also `to_text_to_text`, a classification
table rewritten as seq2seq (template -> verbalizer) to fine-tune T5 the text-to-text way.
Not here: generation (`training/scoring/generation.py`), metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.common.schema import EXAMPLE_ID, LABEL, TARGET, TEXT, TEXT_PAIR, downstream_schema
from training.evaluate.config import PromptConfig as PromptConfig
from training.finetune.features.base import IGNORE_INDEX, strings
from training.models.tokens import causal_bos, pad_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptScores:
    """Prompting results for a table, in table order."""

    scores: np.ndarray  # (N, L) log-probability score of each label's verbalizer
    predictions: np.ndarray  # (N,) int64 argmax of `scores`
    prompts: list[str]  # each query's full prompt (demonstrations included)
    demonstrations: list[list[int]]  # the train rows shown to each query

    def probabilities(self) -> np.ndarray:
        """(N, L) softmax of the scores over the labels (for AUC-ROC)."""
        shifted = self.scores - self.scores.max(axis=1, keepdims=True)
        exp = np.exp(shifted)
        return exp / exp.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]


def _verbalizers(cfg: PromptConfig, labels: Sequence[str]) -> list[str]:
    """The verbalizer of each label index; every label must have one."""
    missing = [label for label in labels if label not in cfg.verbalizers]
    extra = sorted(set(cfg.verbalizers) - set(labels))
    if missing or extra:
        raise ValueError(
            f"verbalizers must name exactly the labels {list(labels)}: "
            f"missing {missing}, unknown {extra}"
        )
    return [cfg.verbalizers[label] for label in labels]


def _fill(template: str, texts: list[str], pairs: list[str] | None) -> list[str]:
    """The template filled with each example's text (and text pair)."""
    if pairs is None:
        return [template.format(text=text) for text in texts]
    return [template.format(text=t, text_pair=p) for t, p in zip(texts, pairs, strict=True)]


def _examples(table: pa.Table, template: str) -> tuple[list[str], list[tuple[str, ...]]]:
    """Each row's filled template, and its identity (text, pair) for excluding the query."""
    texts = strings(table, TEXT)
    pairs = strings(table, TEXT_PAIR) if TEXT_PAIR in table.column_names else None
    identity: list[tuple[str, ...]] = (
        list(zip(texts, pairs, strict=True)) if pairs else [(t,) for t in texts]
    )
    try:
        return _fill(template, texts, pairs), identity
    except (KeyError, IndexError) as err:
        raise ValueError(f"template {template!r} has a field other than text/text_pair") from err


def _draw(rng: np.random.Generator, candidates: int, banned: set[int], k: int) -> list[int]:
    """K distinct indexes below `candidates`, none in `banned`, in random order."""
    order = rng.permutation(candidates)
    picked = [int(i) for i in order if int(i) not in banned][:k]
    if len(picked) < k:
        raise ValueError(f"only {len(picked)} train examples can be demonstrations; k_shot={k}")
    return picked


def build_prompts(
    table: pa.Table,
    labels: Sequence[str],
    cfg: PromptConfig,
    train: pa.Table | None = None,
) -> tuple[list[str], list[list[int]]]:
    """Each query's prompt and the train rows shown in it as demonstrations.

    Zero-shot: the filled template. Few-shot: `cfg.k_shot` train rows drawn for each query
    with the seed `[cfg.seed, query index]` (reproducible, independent of batch), excluding
    every train row with the query's text (and pair), each shown as its filled template
    followed by its label's verbalizer, joined by `cfg.separator`, then the query.
    """
    verbalizers = _verbalizers(cfg, labels)
    queries, identity = _examples(table, cfg.template)
    if cfg.k_shot == 0:
        return queries, [[] for _ in queries]
    if train is None:
        raise ValueError(f"k_shot={cfg.k_shot} needs a train table to draw demonstrations from")
    shown, train_identity = _examples(train, cfg.template)
    train_labels = train.column(LABEL).to_numpy()
    rows_of: dict[tuple[str, ...], set[int]] = {}
    for i, key in enumerate(train_identity):
        rows_of.setdefault(key, set()).add(i)
    prompts, demos = [], []
    for i, (query, key) in enumerate(zip(queries, identity, strict=True)):
        rng = np.random.default_rng([cfg.seed, i])
        picked = _draw(rng, len(shown), rows_of.get(key, set()), cfg.k_shot)
        parts = [shown[j] + verbalizers[int(train_labels[j])] for j in picked]
        prompts.append(cfg.separator.join([*parts, query]))
        demos.append(picked)
    return prompts, demos


def _causal_batch(
    contexts: list[list[int]], continuations: list[list[int]], pad: int, room: int | None
) -> dict[str, torch.Tensor]:
    """Right-padded context + continuation rows; labels mark only the continuation tokens."""
    rows, targets = [], []
    for context, cont in zip(contexts, continuations, strict=True):
        if room is not None:  # keep the end of the context: the query is last
            context = context[max(0, len(context) + len(cont) - room) :]
        rows.append(context + cont)
        targets.append([IGNORE_INDEX] * len(context) + cont)
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, target) in enumerate(zip(rows, targets, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(target)
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probability of each label token under `logits` (B, T, V); 0 where ignored."""
    keep = labels != IGNORE_INDEX
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return torch.where(keep, picked, torch.zeros_like(picked))


def _score_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    continuations: list[list[int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability and token count of each continuation after its prompt."""
    if model.config.is_encoder_decoder:  # T5: prompt -> encoder, continuation -> decoder
        enc = tokenizer(prompts, padding=True, truncation=True, return_tensors="pt")
        width = max(len(c) for c in continuations)
        labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
        for i, cont in enumerate(continuations):
            labels[i, : len(cont)] = torch.tensor(cont)
        batch = {**enc, "labels": labels}
        logits_shift = 0  # decoder logits at t predict label t
    else:
        bos = causal_bos(tokenizer)
        contexts = [bos + row for row in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        positions = getattr(model.config, "n_positions", None) or getattr(
            model.config, "max_position_embeddings", None
        )
        batch = _causal_batch(contexts, continuations, pad_id(tokenizer), positions)
        logits_shift = 1  # logits at t predict token t + 1
    batch = {key: value.to(model.device) for key, value in batch.items()}
    labels = batch.pop("labels") if logits_shift else batch["labels"]
    logits = model(**batch).logits  # (B, T, V)
    if logits_shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    token_logp = _token_log_probs(logits, labels)
    return token_logp.sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)


def score_continuations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    continuations: Sequence[str],
    normalize: Literal["sum", "mean"] = "sum",
    batch_size: int = 16,
) -> np.ndarray:
    """(N, L): how likely `model` finds each continuation right after each prompt.

    A causal LM reads bos (where the vocabulary has its own) + prompt + continuation, prompt and
    continuation tokenized separately so the boundary is exact; a prompt too long for the
    model loses its start. T5 reads the prompt as encoder input and the continuation as decoder
    target. The score is the summed log-probability of the continuation's tokens (`mean`:
    divided by their number).
    """
    conts = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in continuations]
    if any(not c for c in conts):
        raise ValueError(f"every continuation needs at least one token: {list(continuations)}")
    pairs = [(i, j) for i in range(len(prompts)) for j in range(len(conts))]
    scores = np.zeros((len(prompts), len(conts)))
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            for start in range(0, len(pairs), batch_size):
                chunk = pairs[start : start + batch_size]
                total, count = _score_batch(
                    model, tokenizer, [prompts[i] for i, _ in chunk], [conts[j] for _, j in chunk]
                )
                value = total / count if normalize == "mean" else total
                for (i, j), v in zip(chunk, value.tolist(), strict=True):
                    scores[i, j] = v
    finally:
        model.train(was_training)
    return scores


def classify_by_prompting(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    table: pa.Table,
    labels: Sequence[str],
    cfg: PromptConfig,
    train: pa.Table | None = None,
) -> PromptScores:
    """Classify every row of `table` by which label's verbalizer the model finds likeliest.

    Args:
        model: A causal LM (gpt2, llama) or T5.
        tokenizer: Its tokenizer.
        table: A classification table (`text`, optional `text_pair`).
        labels: Label names in index order.
        cfg: Template, verbalizers, shots, seed, normalisation.
        train: Where few-shot demonstrations come from (needed when `cfg.k_shot > 0`).
    """
    prompts, demos = build_prompts(table, labels, cfg, train)
    scores = score_continuations(
        model, tokenizer, prompts, _verbalizers(cfg, labels), cfg.normalize, cfg.batch_size
    )
    predictions = scores.argmax(axis=1).astype(np.int64)
    log.info("prompting (%d-shot): %d examples scored", cfg.k_shot, len(prompts))
    return PromptScores(scores, predictions, prompts, demos)


def to_text_to_text(table: pa.Table, labels: Sequence[str], cfg: PromptConfig) -> pa.Table:
    """A classification table as a seq2seq table: filled template -> stripped verbalizer.

    Fine-tunes T5 the text-to-text way; `classify_by_prompting` with the same `cfg` then
    predicts by scoring each label's verbalizer.
    """
    verbalizers = _verbalizers(cfg, labels)
    sources, _ = _examples(table, cfg.template)
    targets = [verbalizers[int(i)].strip() for i in table.column(LABEL).to_numpy()]
    return pa.table(
        {EXAMPLE_ID: table.column(EXAMPLE_ID), TEXT: sources, TARGET: targets},
        schema=downstream_schema("seq2seq"),
    )
