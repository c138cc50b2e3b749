"""Acceptance: pretraining on the demo corpus visibly helps on the demo's labelled task.

The real path a user takes: `lmpipe compare` on the synthetic demo corpus runs ingest →
tokenizer → encode → examples → pretraining (Ray Train, DeepSpeed), then fine-tunes the same
BERT architecture from the pretrained export and from random initialisation, 3 seeds each, on
the residence task ("Where does Tavor live?" → one of 12 cities). The people of the test split
never occur in the fine-tuning train split (at most 500 examples), so only facts learnt from the
corpus can answer for them. The recipe is `configs/demo.yaml` itself
(`lmpipe compare configs/demo.yaml`); docs/benchmarks.md, "Pretraining helps", has the numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.config import RunConfig, load_config
from tasks.demo.synthetic import SyntheticConfig, write_corpus

pytestmark = [pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[3]
# twelve cities, the same number of people in each (tests/tasks/demo/test_synthetic.py)
CHANCE = 1 / 12


def demo_config(root: Path, mlflow_uri: str) -> RunConfig:
    """`configs/demo.yaml` as `make demo` runs it, pointed at a fresh corpus and workspace."""
    data = root / "demo_data"
    write_corpus(data, SyntheticConfig(seed=0))
    return load_config(
        REPO / "configs" / "demo.yaml",
        [
            f"workspace={root / 'ws'}",
            f"ingest.sources.0.path={data / 'corpus'}",
            f"task.config={REPO / 'configs' / 'tasks' / 'demo_residence.yaml'}",
            f"task.base_dir={data}",
            f"tracking.tracking_uri={mlflow_uri}",
            "tracking.experiment=pretraining-helps",
        ],
    )


def test_pretrained_bert_beats_random_init_and_chance_on_facts_only_the_corpus_holds(
    prefect_api: str, ray_session: str, mlflow_uri: str, tmp_path: Path
) -> None:
    from pipelines.flows.compare_flow import compare_flow

    cfg = demo_config(tmp_path, mlflow_uri)
    assert [e.name() for e in cfg.compare.entries] == ["pretrained", "random"]
    assert cfg.compare.seeds == [0, 1, 2]
    assert cfg.compare.metric == "accuracy"
    out = compare_flow(cfg)
    assert out["downstream"]["splits"]["train"]["rows"] <= 500
    rows = {row["strategy"]: row for row in out["compare"]["rows"]}
    pretrained, random = rows["pretrained"], rows["random"]
    assert len(pretrained["values"]) == len(random["values"]) == 3
    # Averaged over 3 seeds: 5 points over random initialisation, 15 over chance.
    assert pretrained["mean"] - random["mean"] >= 0.05, rows
    assert pretrained["mean"] - CHANCE >= 0.15, rows
