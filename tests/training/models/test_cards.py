"""Model cards: the Hub metadata block `huggingface_hub` reads, round trips and summaries."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from huggingface_hub import ModelCard as HubModelCard

from training.models.cards import (
    PIPELINE_TASKS,
    DataRef,
    FinetuneCard,
    card_summary,
    read_finetune_card,
    render_finetune_card,
    serving_class,
)
from training.models.models import FAMILIES

TUNED = FinetuneCard(
    task_type="classification",
    task_name="residence",
    labels=["Oslo", "Lima"],
    strategy="full",
    base_model="/ws/pretrain/abc/export",
    data=DataRef(path="/ws/downstream/def", fingerprint="task-1"),
    best_epoch=3,
    metric="f1_macro",
    higher_is_better=True,
    test={"accuracy": 0.979, "f1_macro": 0.97, "loss": 0.12},
    git_commit="513984e",
)


def test_a_finetuned_card_carries_the_hub_metadata_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "README.md").write_text(render_finetune_card(TUNED))
    with caplog.at_level(logging.WARNING):
        hub = HubModelCard.load(tmp_path / "README.md")
    assert "metadata block was not found" not in caplog.text
    assert hub.data.library_name == "transformers"
    assert hub.data.pipeline_tag == "text-classification"
    assert set(hub.data.tags) == {"lmpipe", "classification", "full"}
    results = {r.metric_type: r.metric_value for r in hub.data.eval_results}
    assert results == TUNED.test
    assert {r.dataset_name for r in hub.data.eval_results} == {"residence"}
    assert read_finetune_card(tmp_path) == TUNED
    assert "| test f1_macro | 0.9700 |" in hub.text


def test_a_card_summary_is_one_sentence_of_what_the_model_is(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(render_finetune_card(TUNED))
    assert card_summary(tmp_path) == (
        "A classification model for residence, fine-tuned with lmpipe (full) from "
        "/ws/pretrain/abc/export: test f1_macro 0.9700."
    )
    (tmp_path / "README.md").write_text("# tiny\n\nA hand-written card.\n")
    assert card_summary(tmp_path) == "A hand-written card."
    assert read_finetune_card(tmp_path) is None


def test_each_family_serves_with_a_class_its_pipeline_reads() -> None:
    served = {family: serving_class(family) for family in FAMILIES}
    assert served["bert"] == "BertForMaskedLM"  # BertForPreTraining gives no `logits`
    assert served["albert"] == "AlbertForMaskedLM"
    assert served["electra"] == "ElectraModel"  # the discriminator has no masked-LM head
    assert PIPELINE_TASKS["electra"] == "feature-extraction"
    for family, spec in FAMILIES.items():
        if PIPELINE_TASKS[family] == "fill-mask":
            assert served[family].endswith("ForMaskedLM"), family
        elif family != "electra":
            assert served[family] == spec.model_name, family
