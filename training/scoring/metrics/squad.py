"""SQuAD v1.1/v2.0 exact match and F1 for extractive question answering.

There is no offline library for SQuAD scoring, so the official evaluation script's rules are
written here: answer normalisation (lower case, drop punctuation, drop the articles a/an/the,
collapse whitespace), the maximum over the gold answers, and SQuAD v2's unanswerable questions
(no gold answer: only the empty prediction scores 1). Scores are fractions in [0, 1], not the
script's percentages. Span extraction from model logits lives with the QA task, not here.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Normalise an answer the way the official SQuAD script does.

    Lower-cases, removes ASCII punctuation, removes the articles "a", "an" and "the" as whole
    words, and collapses runs of whitespace into single spaces (stripping both ends).
    """
    lowered = text.lower()
    no_punct = "".join(ch for ch in lowered if ch not in _PUNCTUATION)
    no_articles = _ARTICLES.sub(" ", no_punct)
    return " ".join(no_articles.split())


def answer_exact_match(prediction: str, gold: str) -> float:
    """Return 1.0 when the normalised prediction equals the normalised gold answer, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def answer_f1(prediction: str, gold: str) -> float:
    """Return the bag-of-tokens F1 between the normalised prediction and gold answer.

    When either side normalises to no tokens at all (an unanswerable question, or an answer
    made only of articles and punctuation) the F1 is 1.0 if both are empty and 0.0 otherwise.
    """
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _gold_or_empty(golds: Sequence[str]) -> list[str]:
    """Gold answers that survive normalisation, or `[""]` for an unanswerable question."""
    kept = [gold for gold in golds if normalize_answer(gold)]
    return kept or [""]


def _check_qa_inputs(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    """Raise a clear ValueError for misaligned or mistyped QA predictions and references."""
    if len(predictions) != len(references):
        raise ValueError(
            f"question answering: {len(predictions)} predictions but {len(references)} references"
        )
    if not predictions:
        raise ValueError("question answering: no examples to score")
    for i, (prediction, golds) in enumerate(zip(predictions, references, strict=True)):
        if not isinstance(prediction, str):
            raise ValueError(f"question answering: prediction {i} is {prediction!r}, not a string")
        if isinstance(golds, str) or not all(isinstance(gold, str) for gold in golds):
            raise ValueError(
                f"question answering: reference {i} must be a list of answer strings "
                f"([] for an unanswerable question), got {golds!r}"
            )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def squad_metrics(
    predictions: Sequence[str], references: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Score predicted answer strings against each question's gold answers, SQuAD v2 style.

    Args:
        predictions: One answer string per question; "" means "no answer".
        references: Per question, its gold answer texts; an empty list marks an unanswerable
            question (gold answers that normalise to nothing count as absent, as in the
            official script).

    Returns:
        `exact_match` and `f1` (each question's maximum over its gold answers, averaged over
        questions), `has_ans_exact_match`/`has_ans_f1` over the answerable questions and
        `no_ans_exact_match`/`no_ans_f1` over the unanswerable ones (each only when that
        subset is non-empty), and their sizes `has_ans_total`/`no_ans_total`.

    Raises:
        ValueError: The lengths differ, there is nothing to score, or an item has the wrong type
            (a bare string where a list of gold answers belongs, for instance).
    """
    _check_qa_inputs(predictions, references)
    scores: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    for prediction, golds in zip(predictions, references, strict=True):
        kept = _gold_or_empty(golds)
        exact, f1 = scores[kept != [""]]
        exact.append(max(answer_exact_match(prediction, gold) for gold in kept))
        f1.append(max(answer_f1(prediction, gold) for gold in kept))
    all_exact = scores[True][0] + scores[False][0]
    all_f1 = scores[True][1] + scores[False][1]
    out = {"exact_match": _mean(all_exact), "f1": _mean(all_f1)}
    for answerable, prefix in ((True, "has_ans"), (False, "no_ans")):
        exact, f1 = scores[answerable]
        out[f"{prefix}_total"] = float(len(exact))
        if exact:
            out[f"{prefix}_exact_match"] = _mean(exact)
            out[f"{prefix}_f1"] = _mean(f1)
    return out
