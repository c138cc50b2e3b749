"""Evaluation of a task model on a split, in a training loop (sharded by rank) or on its own.

`Evaluator.evaluate` runs the model over this rank's share of a split's features, gathers the
outputs of every rank (so every rank computes the same metrics and takes the same early-stopping
decision) and turns them into per-example predictions: windows aggregated (classification),
piece logits mapped to word tags (NER), start/end logits to answer strings (QA), generated text
(seq2seq) or response log-likelihood (causal LM). Metrics come from
`training/scoring/metrics/metrics.py`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tasks.common import schema
from training.finetune.config import FinetuneConfig
from training.finetune.data import TaskData
from training.finetune.features.features import Features, aggregate_windows
from training.finetune.features.qa import AnswerConfig, postprocess_qa
from training.finetune.features.tokens import word_predictions
from training.scoring.generation import generate_texts
from training.scoring.metrics.metrics import compute_metrics, primary_metric

log = logging.getLogger(__name__)

#: The prefix of a split's metrics in MLflow and on the progress line (`val_f1_macro`,
#: `test_loss`); `Evaluator.evaluate` and `result.json` keep the bare names.
METRIC_PREFIX = {"validation": "val_", "test": "test_"}


class Evaluator:
    """Evaluate a model on a split of `data`: shard by rank, gather, score."""

    def __init__(self, data: TaskData, cfg: FinetuneConfig, rank: int, world: int) -> None:
        """Evaluate `data` with `cfg`'s batch size and decoding, as rank `rank` of `world`."""
        self.data, self.cfg, self.rank, self.world = data, cfg, rank, world
        self.predictions: dict[str, list[Any]] = {}

    def watched_metric(self, name: str | None) -> tuple[str, bool]:
        """The early-stopping metric and whether higher is better (default: primary).

        `name` is a validation metric's bare name (`accuracy`); its MLflow name
        (`val_accuracy`) means the same.
        """
        primary, higher = primary_metric(self.data.task_type)
        name = name.removeprefix(METRIC_PREFIX["validation"]) if name else name
        if name is None or name == primary:
            return primary, higher
        lower = name in ("loss", "perplexity", "mse") or name.endswith("_loss")
        return name, not lower

    def _examples(self, split: str) -> int:
        n = int(self.data.tables[split].num_rows)
        cap = self.cfg.max_eval_examples
        return n if cap is None else min(n, cap)

    def _shard(self, count: int) -> np.ndarray:
        """This rank's indices of `count` items; padded so every rank runs as many batches."""
        padded = np.resize(np.arange(count), -(-count // self.world) * self.world)
        return padded[self.rank :: self.world]

    def _gather(self, mine: list[tuple[int, Any]]) -> dict[int, Any]:
        if not dist.is_initialized() or self.world == 1:
            return dict(mine)
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine)
        return {i: out for part in every for i, out in part}

    def evaluate(
        self, model: torch.nn.Module, split: str, keep_predictions: bool = False
    ) -> dict[str, float]:
        """Metrics of `model` on `split` (the same on every rank); {} if there is no split."""
        if split not in self.data.tables:
            return {}
        was_training = model.training
        model.train(False)
        with torch.no_grad():
            if self.data.task_type in ("seq2seq", "causal_lm"):
                metrics, preds = self._generative(model, split)
            else:
                metrics, preds = self._discriminative(model, split)
        model.train(was_training)
        if keep_predictions:
            self.predictions[split] = preds
        return metrics

    def _forward_features(
        self, model: torch.nn.Module, split: str, limit: int
    ) -> tuple[dict[int, dict[str, np.ndarray]], float, int]:
        """Per-feature outputs of features whose example is below `limit`; loss sum, count."""
        feats = self.data.features[split]
        wanted = np.flatnonzero(feats.example_index < limit)
        mine = wanted[self._shard(len(wanted))]
        device = next(model.parameters()).device
        outputs: list[tuple[int, dict[str, np.ndarray]]] = []
        loss_sum, batches = 0.0, 0
        for start in range(0, len(mine), self.cfg.eval_batch_size):
            ids = mine[start : start + self.cfg.eval_batch_size]
            batch = self.data.batch(split, ids, device)
            out = model(**batch)
            loss_sum += float(out.loss) * len(ids)
            batches += len(ids)
            for j, i in enumerate(ids):
                outputs.append((int(i), _row_outputs(self.data.task_type, out, j, batch)))
        stats = torch.tensor([loss_sum, float(batches)], dtype=torch.float64)
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(stats)
        return self._gather(outputs), float(stats[0]), int(stats[1])

    def _discriminative(
        self, model: torch.nn.Module, split: str
    ) -> tuple[dict[str, float], list[Any]]:
        n = self._examples(split)
        feats = self.data.features[split]
        by_feature, loss_sum, count = self._forward_features(model, split, n)
        order = sorted(by_feature)
        table = self.data.tables[split].slice(0, n)
        sub = _subset(feats, order, n)
        task = self.data.task_type
        metrics: dict[str, float] = {"loss": loss_sum / max(count, 1)}
        if task in ("classification", "regression"):
            logits = np.stack([by_feature[i]["logits"] for i in order])
            agg = aggregate_windows(logits, sub.example_index, n, self.cfg.features.aggregation)
            refs = table.column(schema.LABEL).to_numpy()
            if task == "regression":
                preds: Any = agg.reshape(n)
                metrics |= compute_metrics(task, preds, refs)
                return metrics, preds.tolist()
            probs = _softmax(agg)
            names = self.data.labels
            metrics |= compute_metrics(task, probs, [names[i] for i in refs], labels=names)
            return metrics, probs.argmax(-1).tolist()
        if task == "token_classification":
            logits_list = [by_feature[i]["logits"] for i in order]
            tags = word_predictions(sub, logits_list, self.data.labels)
            names = self.data.labels
            gold = [[names[t] for t in row] for row in table.column(schema.TAGS).to_pylist()]
            metrics |= compute_metrics(task, tags, gold, labels=names)
            return metrics, tags
        starts = [by_feature[i]["start_logits"] for i in order]
        ends = [by_feature[i]["end_logits"] for i in order]
        answers = postprocess_qa(table, sub, starts, ends, AnswerConfig())
        texts = [a.text for a in answers]
        metrics |= compute_metrics(task, texts, table.column(schema.ANSWER_TEXTS).to_pylist())
        return metrics, texts

    def _generative(self, model: torch.nn.Module, split: str) -> tuple[dict[str, float], list[Any]]:
        n = self._examples(split)
        by_feature, loss_sum, count = self._forward_features(model, split, n)
        table = self.data.tables[split].slice(0, n)
        source = schema.TEXT if self.data.task_type == "seq2seq" else schema.PROMPT
        target = schema.TARGET if self.data.task_type == "seq2seq" else schema.RESPONSE
        prompts = [self.data.source_prefix + s for s in table.column(source).to_pylist()]
        mine = self._shard(n)
        texts = generate_texts(
            _plain(model), self.data.tokenizer, [prompts[i] for i in mine], self.cfg.generation
        )
        gathered = self._gather([(int(i), t) for i, t in zip(mine, texts, strict=True)])
        preds = [gathered[i] for i in range(n)]
        refs = table.column(target).to_pylist()
        metrics = {"loss": loss_sum / max(count, 1)}
        if self.data.task_type == "seq2seq":
            return metrics | compute_metrics("seq2seq", preds, refs), preds
        nll = sum(float(o["nll"]) for o in by_feature.values())
        tokens = int(sum(int(o["tokens"]) for o in by_feature.values()))
        extra = compute_metrics("causal_lm", preds, refs, nll_sum=nll, token_count=tokens)
        return metrics | extra, preds


def _plain(model: torch.nn.Module) -> Any:
    # DeepSpeed and DDP wrap the module; generation needs the transformers model itself.
    return getattr(model, "module", model)


def _row_outputs(
    task_type: str, out: Any, j: int, batch: dict[str, torch.Tensor]
) -> dict[str, np.ndarray]:
    """What evaluation keeps of row `j` of a batch's outputs (no padding, no vocab logits)."""
    if task_type == "question_answering":
        return {k: getattr(out, k)[j].float().cpu().numpy() for k in ("start_logits", "end_logits")}
    if task_type == "causal_lm":
        return _response_nll(out.logits[j].float(), batch["labels"][j])
    if task_type == "seq2seq":
        return {}
    logits = out.logits[j].float()  # (C,) or (T, C)
    if logits.ndim == 2:
        logits = logits[: int(batch["attention_mask"][j].sum())]
    return {"logits": logits.cpu().numpy()}


def _response_nll(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, np.ndarray]:
    """Summed next-token NLL of the labelled (response) tokens, and their count."""
    shift_logits, shift_labels = logits[:-1], labels[1:]  # (T-1, V), (T-1,)
    keep = shift_labels != -100
    if not bool(keep.any()):
        return {"nll": np.asarray(0.0), "tokens": np.asarray(0)}
    nll = torch.nn.functional.cross_entropy(shift_logits[keep], shift_labels[keep], reduction="sum")
    return {"nll": np.asarray(float(nll)), "tokens": np.asarray(int(keep.sum()))}


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def _subset(feats: Features, order: list[int], n: int) -> Features:
    """`feats` restricted to the features `order` (every feature of the first `n` examples)."""
    idx = np.asarray(order, dtype=np.int64)

    def take(col: Any) -> Any:
        return col[idx] if isinstance(col, np.ndarray) else [col[i] for i in idx]

    return dataclasses.replace(
        feats,
        inputs={k: take(v) for k, v in feats.inputs.items()},
        example_index=feats.example_index[idx],
        num_examples=n,
        word_index=None if feats.word_index is None else take(feats.word_index),
        num_words=None if feats.num_words is None else feats.num_words[:n],
        offsets=None if feats.offsets is None else take(feats.offsets),
        null_index=None if feats.null_index is None else feats.null_index[idx],
    )
