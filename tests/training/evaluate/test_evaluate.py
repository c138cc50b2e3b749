"""The evaluate stage on tiny models: probes, generation, sentence-embedding similarity."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.downstream.config import DatasetConfig, load_dataset_config
from tasks.downstream.stage import prepare_downstream
from training.evaluate.stage import EvaluateConfig, evaluate_model, evaluation_report

REPO = Path(__file__).resolve().parents[3]


def test_sts_pairs_are_scored_by_embedding_cosine_against_gold(
    tiny_base_models: dict[str, Path], shared_data: Path, tmp_path: Path
) -> None:
    cfg = load_dataset_config(REPO / "configs/tasks/stsb.yaml")
    prepare_downstream(cfg, shared_data, tmp_path / "stsb")
    result = evaluate_model(
        tiny_base_models["bert"],
        EvaluateConfig(split="validation", max_examples=5),
        task_dir=tmp_path / "stsb",
    )
    metrics = result["similarity"]["metrics"]
    assert result["similarity"]["examples"] == 5
    assert -1.0 <= metrics["cosine_mean"] <= 1.0
    assert -1.0 <= metrics["cosine_spearman"] <= 1.0
    files, text = evaluation_report(result, tmp_path / "report")
    assert "Sentence-embedding similarity (5 pairs)" in text
    assert all(f.is_file() for f in files)


def test_identical_sentences_have_cosine_one_whatever_the_padding(
    tiny_base_models: dict[str, Path], tmp_path: Path
) -> None:
    rows = ["the movie was good", "a very bad plot and a poor actor", "great"]
    lines = ["a,b,score,split"] + [f"{t},{t},{i},validation" for i, t in enumerate(rows)]
    lines += [f"{t},{t},1,train" for t in rows]
    (tmp_path / "sts.csv").write_text("\n".join(lines) + "\n")
    cfg = DatasetConfig.model_validate(
        {
            "name": "same",
            "task_type": "regression",
            "path": "sts.csv",
            "split_column": "split",
            "split_values": {"train": "train", "validation": "validation"},
            "columns": {"text": "a", "text_pair": "b", "label": "score"},
        }
    )
    prepare_downstream(cfg, tmp_path, tmp_path / "prepared")
    for family in ("bert", "gpt2", "t5"):
        result = evaluate_model(
            tiny_base_models[family],
            EvaluateConfig(split="validation"),
            task_dir=tmp_path / "prepared",
        )
        assert result["similarity"]["metrics"]["cosine_mean"] == pytest.approx(1.0, abs=1e-5)


def test_fill_mask_probes_need_the_mask_placeholder(
    tiny_base_models: dict[str, Path],
) -> None:
    from training.evaluate.intrinsic import IntrinsicConfig

    cfg = EvaluateConfig(intrinsic=IntrinsicConfig(fill_mask=["no placeholder here"]))
    with pytest.raises(ValueError, match=r"has no \[MASK\]"):
        evaluate_model(tiny_base_models["bert"], cfg)
