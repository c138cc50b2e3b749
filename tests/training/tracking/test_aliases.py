"""The gated alias's decision (`decide_candidate`) and the selection an export's card gives."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from training.models.cards import (
    DataRef,
    FinetuneCard,
    ModelCard,
    TokenizerRef,
    render_card,
    render_finetune_card,
)
from training.tracking.aliases import Selection, decide_candidate, describe, selection_of

ACCURACY = Selection("test_accuracy", 0.979, True, "task-1")
LOSS = Selection("eval_loss", 2.5, False, "ex-1")


def test_a_worse_version_does_not_take_the_alias() -> None:
    lora = Selection("test_accuracy", 0.083, True, "task-1")
    decision = decide_candidate(lora, ACCURACY, "3")
    assert not decision.move
    assert decision.reason.startswith("test_accuracy 0.083 < 0.979 of version 3")
    assert decision.tags() == {"candidate_decision": "kept", "candidate_reason": decision.reason}


def test_an_equal_or_better_version_takes_the_alias() -> None:
    assert decide_candidate(ACCURACY, ACCURACY, "3").move
    better = decide_candidate(Selection("test_accuracy", 0.99, True, "task-1"), ACCURACY, "3")
    assert better.move
    assert "0.99 >= 0.979 of version 3" in better.reason


def test_a_loss_is_better_when_lower() -> None:
    assert decide_candidate(Selection("eval_loss", 2.0, False, "ex-1"), LOSS, "1").move
    worse = decide_candidate(Selection("eval_loss", 3.0, False, "ex-1"), LOSS, "1")
    assert not worse.move
    assert "eval_loss 3 > 2.5 of version 1" in worse.reason


def test_a_nan_metric_is_worse_than_any_number() -> None:
    assert not decide_candidate(Selection("eval_loss", math.nan, False, "ex-1"), LOSS, "1").move
    nan_held = Selection("eval_loss", math.nan, False, "ex-1")
    assert decide_candidate(LOSS, nan_held, "1").move


def test_other_data_moves_the_alias_and_says_why() -> None:
    worse_elsewhere = Selection("test_accuracy", 0.083, True, "task-2")
    decision = decide_candidate(worse_elsewhere, ACCURACY, "3")
    assert decision.move
    assert "not comparable" in decision.reason
    assert "task-2" in decision.reason
    assert "task-1" in decision.reason


@pytest.mark.parametrize(
    "new",
    [Selection(None, None, False, None), Selection("test_accuracy", None, True, "task-1")],
    ids=["no metric", "no value"],
)
def test_a_version_without_a_metric_takes_the_alias(new: Selection) -> None:
    decision = decide_candidate(new, ACCURACY, "3")
    assert decision.move
    assert "no selection metric" in decision.reason


def test_the_alias_moves_when_the_holder_has_no_such_metric() -> None:
    assert decide_candidate(ACCURACY, Selection(None, None, False, None), "2").move
    assert decide_candidate(ACCURACY, LOSS, "2").move  # another metric altogether


def test_the_first_version_takes_the_alias() -> None:
    decision = decide_candidate(LOSS, None, None)
    assert decision.move
    assert decision.reason == "no version held the alias"


def test_a_selection_round_trips_through_version_tags() -> None:
    for selection in (ACCURACY, LOSS, Selection(None, None, False, None)):
        assert Selection.from_tags(selection.tags()) == selection


def test_the_description_is_the_summary_then_the_decision() -> None:
    decision = decide_candidate(Selection("test_accuracy", 0.083, True, "task-1"), ACCURACY, "3")
    text = describe("A classification model.", "candidate", decision)
    assert text.splitlines()[0] == "A classification model."
    assert text.splitlines()[-1].startswith("@candidate stayed: test_accuracy 0.083 < 0.979")


def test_selection_comes_from_the_export_card(tmp_path: Path) -> None:
    pretrained = ModelCard(
        family="bert",
        size="tiny",
        parameters=10,
        objective="mlm+nsp",
        steps=1,
        tokens_seen=1,
        data=DataRef(path="examples", fingerprint="ex-1"),
        tokenizer=TokenizerRef(fingerprint="tok", family="wordpiece", vocab_size=100),
        metrics={"eval_loss": 2.5, "train_loss": 3.0},
        git_commit="abc",
    )
    (tmp_path / "pre").mkdir()
    (tmp_path / "pre" / "README.md").write_text(render_card(pretrained))
    assert selection_of(tmp_path / "pre") == LOSS
    tuned = FinetuneCard(
        task_type="classification",
        task_name="residence",
        labels=["Oslo", "Lima"],
        strategy="lora",
        base_model="workspace/pretrain/x/export",
        data=DataRef(path="downstream/x", fingerprint="task-1"),
        best_epoch=1,
        metric="accuracy",
        higher_is_better=True,
        test={"accuracy": 0.979, "loss": 0.1},
        git_commit="abc",
    )
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "README.md").write_text(render_finetune_card(tuned))
    assert selection_of(tmp_path / "tuned") == ACCURACY
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "README.md").write_text("# A card without metadata\n")
    assert selection_of(tmp_path / "plain") == Selection(None, None, False, None)
