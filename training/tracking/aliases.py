"""Which registered version an alias points at: `newest` always, `candidate` when no worse.

A new version is compared with the one holding the gated alias (the registration's, by default
`candidate`) on its selection metric (`Selection`): a pretrained model's held-out `eval_loss`
(lower is better), a fine-tuned model's primary test metric (`training.scoring.metrics.metrics.
primary_metric`), read from the export's model card. The alias moves when the new version is no
worse, and also, with the reason said, when the two are not comparable: no version holds the
alias, either has no metric, the metrics differ, or they were measured on different data (a
different data fingerprint). `newest` (MLflow reserves `latest`) always moves. The decision is
the version's `candidate_decision` and `candidate_reason` tags and the last line of its
description. Not here: logging and registering the model (`training/tracking/registry.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.models.cards import (
    FINETUNED_KEY,
    PRETRAINED_KEY,
    FinetuneCard,
    ModelCard,
    card_metadata,
)

NEWEST_ALIAS = "newest"  # MLflow reserves `latest` for the highest version number
# The version tags that record a version's selection metric and the decision about the alias.
METRIC_TAG, VALUE_TAG, GOAL_TAG = "selection_metric", "selection_value", "selection_goal"
DATA_TAG = "data_fingerprint"
DECISION_TAG, REASON_TAG = "candidate_decision", "candidate_reason"
_PRETRAINED_METRIC = "eval_loss"


@dataclass(frozen=True)
class Selection:
    """How good a version is, and on what data: what the gated alias compares.

    Attributes:
        metric: The metric's name as MLflow logs it, e.g. `eval_loss`, `test_f1_macro`.
        value: Its value; None when the run recorded none.
        higher_is_better: Whether a larger value is better.
        data_fingerprint: The data it was measured on; None when unknown.
    """

    metric: str | None
    value: float | None
    higher_is_better: bool
    data_fingerprint: str | None

    def tags(self) -> dict[str, str]:
        """The version tags that record this selection (read back by `from_tags`)."""
        tags = {GOAL_TAG: "max" if self.higher_is_better else "min"}
        if self.metric is not None:
            tags[METRIC_TAG] = self.metric
        if self.value is not None:
            tags[VALUE_TAG] = repr(self.value)
        if self.data_fingerprint is not None:
            tags[DATA_TAG] = self.data_fingerprint
        return tags

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> Selection:
        """The selection recorded in a version's tags (nothing recorded: no metric)."""
        value = tags.get(VALUE_TAG)
        return cls(
            tags.get(METRIC_TAG),
            float(value) if value is not None else None,
            tags.get(GOAL_TAG) == "max",
            tags.get(DATA_TAG),
        )


@dataclass(frozen=True)
class AliasDecision:
    """Whether the gated alias moves to the new version, and why."""

    move: bool
    reason: str

    def tags(self) -> dict[str, str]:
        """The version tags that record the decision."""
        return {DECISION_TAG: "moved" if self.move else "kept", REASON_TAG: self.reason[:5000]}


def selection_of(hf_dir: Path) -> Selection:
    """The selection of an export, from its model card's metadata block.

    A pretrained card gives its final `eval_loss` on its examples; a fine-tuned card its
    primary test metric on its prepared task. A card without lmpipe's metadata: no metric.
    """
    meta = card_metadata(hf_dir)
    if PRETRAINED_KEY in meta:
        card = ModelCard.model_validate(meta[PRETRAINED_KEY])
        loss = card.metrics.get(_PRETRAINED_METRIC)
        return Selection(_PRETRAINED_METRIC, loss, False, card.data.fingerprint or None)
    if FINETUNED_KEY in meta:
        tuned = FinetuneCard.model_validate(meta[FINETUNED_KEY])
        value = tuned.test.get(tuned.metric)
        metric = f"test_{tuned.metric}"
        return Selection(metric, value, tuned.higher_is_better, tuned.data.fingerprint or None)
    return Selection(None, None, False, None)


def _show(value: float) -> str:
    return f"{value:.4g}"


def decide_candidate(
    new: Selection, current: Selection | None, current_version: str | None
) -> AliasDecision:
    """Whether the gated alias moves from `current_version` (None: nobody holds it) to `new`.

    It moves when `new` is no worse than `current` on the same metric and data, or when the two
    cannot be compared; it stays only when `new` is measurably worse.
    """
    if current is None or current_version is None:
        return AliasDecision(True, "no version held the alias")
    held = f"version {current_version}"
    if new.metric is None or new.value is None:
        return AliasDecision(True, f"this version has no selection metric to compare with {held}")
    if current.metric != new.metric or current.value is None:
        return AliasDecision(True, f"{held} has no {new.metric} to compare with")
    if new.data_fingerprint is None or new.data_fingerprint != current.data_fingerprint:
        return AliasDecision(
            True,
            f"not comparable: {new.metric} is measured on data {new.data_fingerprint}, that of "
            f"{held} on {current.data_fingerprint}",
        )
    better = ">=" if new.higher_is_better else "<="
    if _no_worse(new.value, current.value, new.higher_is_better):
        return AliasDecision(
            True,
            f"{new.metric} {_show(new.value)} {better} {_show(current.value)} of {held} "
            f"(same data {new.data_fingerprint})",
        )
    worse = "<" if new.higher_is_better else ">"
    return AliasDecision(
        False,
        f"{new.metric} {_show(new.value)} {worse} {_show(current.value)} of {held}, which keeps "
        f"the alias (same data {new.data_fingerprint})",
    )


def _no_worse(value: float, reference: float, higher_is_better: bool) -> bool:
    """`value` is at least as good as `reference`; NaN is worse than any number."""
    if math.isnan(value):
        return math.isnan(reference)
    if math.isnan(reference):
        return True
    return value >= reference if higher_is_better else value <= reference


def current_holder(client: Any, name: str, alias: str) -> tuple[str | None, Selection | None]:
    """The version holding `alias` of registered model `name` and its selection; else Nones."""
    from mlflow.exceptions import MlflowException

    try:
        held = client.get_model_version_by_alias(name, alias)
    except MlflowException:  # the alias is not set
        return None, None
    return str(held.version), Selection.from_tags(dict(held.tags))


def describe(summary: str, alias: str, decision: AliasDecision) -> str:
    """A version's description: its card's summary, then the alias decision."""
    verb = "moved here" if decision.move else "stayed"
    line = f"@{alias} {verb}: {decision.reason}."
    return f"{summary}\n\n{line}" if summary else line


def model_description(alias: str) -> str:
    """The registered model's description: what its aliases mean."""
    return (
        f"Models registered by lmpipe. @{NEWEST_ALIAS}: the newest version. @{alias}: the "
        "newest version that is no worse than the one that held it before, on its selection "
        "metric (pretrained: eval_loss, lower is better; fine-tuned: the task's primary test "
        "metric) and the same data; a version that cannot be compared takes it, and its "
        "description says why."
    )
