"""Evaluation metrics as pure functions (NumPy or lists in, floats out), and their registry.

The metrics come from scikit-learn, SciPy, seqeval, sacrebleu and rouge-score; only SQuAD scoring
(no offline library) is ours, in `training/scoring/metrics/squad.py`. `compute_metrics` dispatches
on a `tasks.common.schema.DOWNSTREAM_TASK_TYPES` task type and returns stable keys (fractions in [0,
1], except `bleu`/`chrf` on sacrebleu's 0-100); `primary_metric` picks the model-selection one. See
docs/metrics.md. No torch here: logits to predictions or probabilities is the caller's job.

The metric libraries are imported inside the functions that use them: together (SciPy, pandas
through scikit-learn, NLTK through rouge-score) they cost every `lmpipe` command about a second
at start, and a cached pipeline run computes no metric.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence, Sized
from typing import Any

import numpy as np
import numpy.typing as npt

from tasks.common.schema import DOWNSTREAM_TASK_TYPES
from training.scoring.metrics.squad import squad_metrics

Label = int | str
FloatArray = npt.NDArray[np.float64]

_PRIMARY: dict[str, tuple[str, bool]] = {
    "classification": ("f1_macro", True),
    "regression": ("pearson", True),
    "token_classification": ("entity_f1", True),
    "question_answering": ("f1", True),
    "seq2seq": ("rougeL", True),
    "causal_lm": ("perplexity", False),
}
_ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
_PROBABILITY_TOLERANCE = 1e-3


def _check_aligned(what: str, predictions: Sized, references: Sized) -> None:
    """Raise ValueError unless `predictions` and `references` are equally long and non-empty."""
    if len(predictions) != len(references):
        raise ValueError(f"{what}: {len(predictions)} predictions but {len(references)} references")
    if len(references) == 0:
        raise ValueError(f"{what}: no examples to score")


def _check_known(what: str, values: Sequence[Any], labels: Sequence[Label]) -> None:
    """Raise ValueError naming the first item of `values` that is not one of `labels`."""
    known = set(labels)
    for i, value in enumerate(values):
        if value not in known:
            raise ValueError(f"{what}[{i}] = {value!r} is not a known label; labels are {labels}")


def _as_probabilities(predictions: npt.ArrayLike, n_labels: int) -> FloatArray:
    """Validate an (N, C) class-probability matrix: C columns, non-negative rows summing to 1."""
    probs = np.asarray(predictions, dtype=np.float64)  # (N, C)
    if probs.shape[1] != n_labels:
        raise ValueError(
            f"predictions have {probs.shape[1]} columns but there are {n_labels} labels"
        )
    sums = probs.sum(axis=1)
    bad = np.flatnonzero((probs < 0).any(axis=1) | (np.abs(sums - 1) > _PROBABILITY_TOLERANCE))
    if bad.size:
        raise ValueError(
            f"predictions row {bad[0]} is not a probability distribution (sums to "
            f"{sums[bad[0]]:.4g}); pass probabilities, e.g. scipy.special.softmax(logits, axis=1)"
        )
    return probs


def auc_roc(references: Sequence[Label], scores: npt.ArrayLike, labels: Sequence[Label]) -> float:
    """Return the area under the ROC curve (scikit-learn).

    Two labels (`labels[1]` is the positive class): `scores` is the positive class's score per
    example, (N,), or the (N, 2) probability matrix. More labels: the (N, C) probability matrix
    (column j is `labels[j]`), scored one-vs-rest and macro-averaged over the classes that occur
    in `references` (a class that never occurs has no ROC curve, so it is left out).

    Raises:
        ValueError: Fewer than two classes occur in `references`, or the scores are malformed.
    """
    from sklearn import metrics as skm

    _check_aligned("auc_roc", np.asarray(scores), references)
    present = [label for label in labels if label in set(references)]
    if len(present) < 2:
        raise ValueError(f"auc_roc is undefined: only class {present} occurs in the references")
    onehot = np.array([[ref == label for label in labels] for ref in references])  # (N, C)
    matrix = np.asarray(scores, dtype=np.float64)
    if matrix.ndim == 1:
        if len(labels) != 2:
            raise ValueError(f"1-D scores need exactly two labels, got {len(labels)}")
        return float(skm.roc_auc_score(onehot[:, 1], matrix))
    probs = _as_probabilities(matrix, len(labels))
    if len(labels) == 2:
        return float(skm.roc_auc_score(onehot[:, 1], probs[:, 1]))
    keep = onehot.any(axis=0)
    return float(skm.roc_auc_score(onehot[:, keep], probs[:, keep], average="macro"))


def classification_metrics(
    predictions: npt.ArrayLike, references: Sequence[Label], labels: Sequence[Label]
) -> dict[str, float]:
    """Score single-label classification.

    Args:
        predictions: The predicted label per example, shape (N,), or an (N, C) matrix of class
            probabilities (column j is `labels[j]`; the prediction is the arg-max, and the
            matrix also yields `auc_roc`).
        references: The true label per example.
        labels: Every label in its fixed order. Classes absent from both predictions and
            references still count in the macro averages, with precision, recall and F1 of 0
            (`zero_division=0`).

    Returns:
        `accuracy`, `precision_/recall_/f1_` + `macro`/`micro`/`weighted`, `mcc`, `f1_positive`
        (two labels only: F1 of `labels[1]`) and `auc_roc` (probability input only).
    """
    from sklearn import metrics as skm

    raw = np.asarray(predictions)
    _check_aligned("classification", raw, references)
    _check_known("references", np.asarray(references).tolist(), labels)
    label_array = np.asarray(labels)
    y_pred = (
        label_array[_as_probabilities(raw, len(labels)).argmax(axis=1)] if raw.ndim == 2 else raw
    )
    _check_known("predictions", y_pred.tolist(), labels)
    y_true = np.asarray(references)
    out = {"accuracy": float(skm.accuracy_score(y_true, y_pred))}
    for average in ("macro", "micro", "weighted"):
        p, r, f, _ = skm.precision_recall_fscore_support(
            y_true, y_pred, labels=label_array, average=average, zero_division=0
        )
        out |= {
            f"precision_{average}": float(p),
            f"recall_{average}": float(r),
            f"f1_{average}": float(f),
        }
    out["mcc"] = float(skm.matthews_corrcoef(y_true, y_pred))
    if len(labels) == 2:
        out["f1_positive"] = float(
            skm.f1_score(y_true, y_pred, labels=[labels[1]], average="macro", zero_division=0)
        )
    if raw.ndim == 2:
        out["auc_roc"] = auc_roc(references, raw, labels)
    return out


def regression_metrics(predictions: npt.ArrayLike, references: npt.ArrayLike) -> dict[str, float]:
    """Score regression: `pearson`, `spearman` (SciPy) and `mse` (scikit-learn).

    Predictions of shape (N, 1), as a one-output regression head gives them, are flattened. A
    correlation with a constant input is undefined and comes back as NaN.
    """
    from scipy import stats
    from sklearn import metrics as skm

    y_pred = np.asarray(predictions, dtype=np.float64).reshape(-1)
    y_true = np.asarray(references, dtype=np.float64).reshape(-1)
    _check_aligned("regression", y_pred, y_true)
    if len(y_true) < 2:
        raise ValueError("regression: correlations need at least two examples")
    if not (np.isfinite(y_pred).all() and np.isfinite(y_true).all()):
        raise ValueError("regression: predictions and references must be finite numbers")
    with warnings.catch_warnings():  # constant input: SciPy warns and returns NaN
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        pearson = stats.pearsonr(y_pred, y_true).statistic
        spearman = stats.spearmanr(y_pred, y_true).statistic
    mse = skm.mean_squared_error(y_true, y_pred)
    return {"pearson": float(pearson), "spearman": float(spearman), "mse": float(mse)}


def _check_tag_sequences(
    predictions: Sequence[Sequence[str]],
    references: Sequence[Sequence[str]],
    labels: Sequence[Label] | None,
) -> None:
    """Raise ValueError naming the example and position of a misaligned or malformed BIO tag."""
    _check_aligned("token_classification", predictions, references)
    for side, sequences in (("predictions", predictions), ("references", references)):
        for i, tags in enumerate(sequences):
            if isinstance(tags, str) or len(tags) != len(references[i]):
                raise ValueError(
                    f"token_classification: {side}[{i}] must be a list of "
                    f"{len(references[i])} tags, got {tags!r}"
                )
            for j, tag in enumerate(tags):
                bio = tag == "O" or (isinstance(tag, str) and tag[:2] in ("B-", "I-") and tag[2:])
                if not bio or (labels is not None and tag not in labels):
                    allowed = list(labels) if labels is not None else "'O', 'B-<type>', 'I-<type>'"
                    raise ValueError(
                        f"token_classification: {side}[{i}][{j}] = {tag!r} is not a known BIO "
                        f"tag; allowed: {allowed}"
                    )


def token_classification_metrics(
    predictions: Sequence[Sequence[str]],
    references: Sequence[Sequence[str]],
    labels: Sequence[Label] | None = None,
) -> dict[str, float]:
    """Score BIO tagging with seqeval: entity-level micro P/R/F1 and token accuracy.

    `entity_precision`/`entity_recall`/`entity_f1` use seqeval's default (conlleval-compatible)
    mode, the convention of published CoNLL-2003 numbers: an `I-X` after `O` or after another
    type starts a new entity. `entity_*_strict` use mode="strict" with the IOB2 scheme: an
    entity must start with `B-X` and every tag of it must match, so an orphan `I-X` is no
    entity. `token_accuracy` is the fraction of tokens whose tag is right.

    Args:
        predictions: The predicted tag strings, one list per sentence.
        references: The gold tag strings, aligned token by token with `predictions`.
        labels: If given, the allowed tag strings; any other tag is an error.
    """
    import seqeval.metrics
    from seqeval.scheme import IOB2

    _check_tag_sequences(predictions, references, labels)
    y_true, y_pred = [list(tags) for tags in references], [list(tags) for tags in predictions]
    out = {"token_accuracy": float(seqeval.metrics.accuracy_score(y_true, y_pred))}
    for suffix, mode_args in (("", {}), ("_strict", {"mode": "strict", "scheme": IOB2})):
        for name, fn in (
            ("precision", seqeval.metrics.precision_score),
            ("recall", seqeval.metrics.recall_score),
            ("f1", seqeval.metrics.f1_score),
        ):
            score = fn(y_true, y_pred, average="micro", zero_division=0, **mode_args)
            out[f"entity_{name}{suffix}"] = float(score)
    return out


def _reference_streams(
    predictions: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]
) -> list[list[str]]:
    """Per-example reference lists (one or several), all the same length, as sacrebleu needs."""
    _check_aligned("generation", predictions, references)
    per_example = [[ref] if isinstance(ref, str) else list(ref) for ref in references]
    counts = {len(refs) for refs in per_example}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            "generation: every example needs the same number (>= 1) of references; "
            f"got counts {sorted(counts)}"
        )
    for i, text in enumerate(predictions):
        if not isinstance(text, str):
            raise ValueError(f"generation: prediction {i} is {text!r}, not a string")
    return per_example


def generation_metrics(
    predictions: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]
) -> dict[str, float]:
    """Score generated text: corpus BLEU and chrF (sacrebleu) and ROUGE-1/2/L F (rouge-score).

    BLEU and chrF are corpus-level with sacrebleu's defaults (13a tokenisation, exponential
    smoothing; 0-100). ROUGE is the F-measure with Porter stemming, computed per example
    (the best over that example's references) and averaged over examples (0-1).

    Args:
        predictions: One generated string per example.
        references: One reference string per example, or a list of references per example
            (every example must have the same number).
    """
    import sacrebleu
    from rouge_score import rouge_scorer

    per_example = _reference_streams(predictions, references)
    streams = [list(stream) for stream in zip(*per_example, strict=True)]
    out = {
        "bleu": float(sacrebleu.corpus_bleu(list(predictions), streams).score),
        "chrf": float(sacrebleu.corpus_chrf(list(predictions), streams).score),
    }
    scorer = rouge_scorer.RougeScorer(list(_ROUGE_TYPES), use_stemmer=True)
    scores = [
        scorer.score_multi(refs, pred) for pred, refs in zip(predictions, per_example, strict=True)
    ]
    for rouge_type in _ROUGE_TYPES:
        out[rouge_type] = float(np.mean([score[rouge_type].fmeasure for score in scores]))
    return out


def perplexity(nll_sum: float, token_count: int) -> float:
    """Return exp(nll_sum / token_count), the perplexity of a summed NLL in nats.

    Overflow (a mean NLL above about 709.78 nats) gives `inf` rather than an exception.

    Raises:
        ValueError: `token_count` is not positive or `nll_sum` is negative.
    """
    if token_count <= 0:
        raise ValueError(f"perplexity: token_count must be positive, got {token_count}")
    if nll_sum < 0:
        raise ValueError(f"perplexity: nll_sum is a negative log-likelihood, got {nll_sum}")
    try:
        return math.exp(nll_sum / token_count)
    except OverflowError:
        return math.inf


def masked_lm_accuracy(
    predicted_ids: npt.ArrayLike, label_ids: npt.ArrayLike, ignore_index: int = -100
) -> float:
    """Return the fraction of scored positions (label != `ignore_index`) predicted right.

    Raises:
        ValueError: The shapes differ or no position is scored.
    """
    pred, gold = np.asarray(predicted_ids), np.asarray(label_ids)
    if pred.shape != gold.shape:
        raise ValueError(f"masked_lm_accuracy: shapes {pred.shape} and {gold.shape} differ")
    scored = gold != ignore_index
    if not scored.any():
        raise ValueError(f"masked_lm_accuracy: every label is ignore_index ({ignore_index})")
    return float((pred[scored] == gold[scored]).mean())


def cosine_similarities(left: npt.ArrayLike, right: npt.ArrayLike) -> FloatArray:
    """Return the cosine similarity of each row pair of two (N, D) embedding matrices, (N,).

    Raises:
        ValueError: The shapes differ or a row is the zero vector (its cosine is undefined).
    """
    a, b = np.asarray(left, dtype=np.float64), np.asarray(right, dtype=np.float64)  # (N, D)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"cosine_similarities: need two (N, D) arrays, got {a.shape}, {b.shape}")
    norms: FloatArray = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)  # (N,)
    if (norms == 0).any():
        raise ValueError(f"cosine_similarities: row {np.argmin(norms)} has a zero embedding")
    dots: FloatArray = (a * b).sum(axis=1)  # (N,)
    return dots / norms


def embedding_similarity_metrics(
    left: npt.ArrayLike, right: npt.ArrayLike, gold_scores: npt.ArrayLike
) -> dict[str, float]:
    """Score sentence embeddings on a similarity task (the STS protocol).

    The cosine of each pair's embeddings is correlated with the gold similarity scores:
    `cosine_spearman` (the usual headline number) and `cosine_pearson`; `cosine_mean` is the
    average cosine.
    """
    cosines = cosine_similarities(left, right)
    scores = regression_metrics(cosines, gold_scores)
    return {
        "cosine_pearson": scores["pearson"],
        "cosine_spearman": scores["spearman"],
        "cosine_mean": float(cosines.mean()),
    }


def _causal_lm_metrics(
    predictions: Sequence[str],
    references: Sequence[str],
    nll_sum: float | None,
    token_count: int | None,
) -> dict[str, float]:
    """Perplexity of the responses (from a summed NLL) plus generation scores, if any given."""
    if (nll_sum is None) != (token_count is None):
        raise ValueError("causal_lm: pass nll_sum and token_count together")
    if nll_sum is None and len(predictions) == 0 and len(references) == 0:
        raise ValueError("causal_lm: pass nll_sum/token_count, generated responses, or both")
    out = generation_metrics(predictions, references) if predictions or references else {}
    if nll_sum is not None and token_count is not None:
        out["perplexity"] = perplexity(nll_sum, token_count)
    return out


def compute_metrics(
    task_type: str,
    predictions: Any,
    references: Any,
    *,
    labels: Sequence[Label] | None = None,
    nll_sum: float | None = None,
    token_count: int | None = None,
) -> dict[str, float]:
    """Compute the metrics of a downstream task type, with stable key names.

    Args:
        task_type: One of `tasks.common.schema.DOWNSTREAM_TASK_TYPES`.
        predictions: What the matching `*_metrics` function takes (seq2seq and causal_lm:
            `generation_metrics`; question_answering: `squad_metrics`).
        references: The gold counterpart, likewise.
        labels: classification: every label in order (required); token_classification: the
            allowed tag strings (optional).
        nll_sum: causal_lm: summed response-token negative log-likelihood in nats; with
            `token_count` (the tokens it covers) it adds `perplexity`.
        token_count: causal_lm: the number of tokens `nll_sum` covers.

    Raises:
        ValueError: Unknown task type, or inputs that do not fit it.
    """
    if task_type == "classification":
        if labels is None:
            raise ValueError("classification metrics need the label list (labels=...)")
        return classification_metrics(predictions, references, labels)
    if task_type == "causal_lm":
        return _causal_lm_metrics(predictions, references, nll_sum, token_count)
    if task_type == "regression":
        return regression_metrics(predictions, references)
    if task_type == "token_classification":
        return token_classification_metrics(predictions, references, labels)
    if task_type == "question_answering":
        return squad_metrics(predictions, references)
    if task_type == "seq2seq":
        return generation_metrics(predictions, references)
    raise ValueError(f"unknown task type {task_type!r}; one of {DOWNSTREAM_TASK_TYPES}")


def primary_metric(task_type: str) -> tuple[str, bool]:
    """Return `(metric key, higher_is_better)` for early stopping and model selection."""
    if task_type not in _PRIMARY:
        raise ValueError(f"unknown task type {task_type!r}; one of {DOWNSTREAM_TASK_TYPES}")
    return _PRIMARY[task_type]
