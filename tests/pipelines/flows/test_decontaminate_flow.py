"""Decontamination in the flows: Prefect (session API), Ray, MLflow, the CLI summary."""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines.cli.main import main
from pipelines.config import load_config
from pipelines.flows.tokenizer_flow import corpus_path
from tasks.common import schema
from tasks.common.io import read_ipc_stream

EVAL_SENTENCE = (
    "The old lighthouse keeper counted forty seven ships passing the harbour wall "
    "before the storm arrived that night"
)
PLANTED = "Someone wrote that " + " ".join(EVAL_SENTENCE.split()[2:15]) + " and left."
FILLER = [
    f"Filler document {i} describes the weather in town {i} and the price of bread there."
    for i in range(60)
]


def manifest(path: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((Path(path) / "manifest.json").read_text())
    return loaded


@pytest.fixture
def recipe(tmp_path: Path, mlflow_uri: str) -> Path:
    """A corpus with one document quoting 13 words of an eval sentence, and the eval task."""
    (tmp_path / "eval.csv").write_text(
        f"text,label,split\nA short train sentence.,neg,train\n{EVAL_SENTENCE},pos,validation\n"
    )
    task = {
        "name": "evalset",
        "task_type": "classification",
        "path": "eval.csv",
        "split_column": "split",
        "split_values": {"train": "train", "validation": "validation"},
        "columns": {"text": "text", "label": "label"},
        "labels": ["neg", "pos"],
    }
    (tmp_path / "evalset.yaml").write_text(yaml.safe_dump(task))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*FILLER, PLANTED]))
    config = {
        "name": "decontaminate-flow",
        "workspace": str(tmp_path / "ws"),
        "tracking": {"tracking_uri": mlflow_uri, "experiment": "decontaminate-flow"},
        "ingest": {"sources": [{"path": str(corpus)}], "split": {"validation": 0.1, "test": 0.1}},
        "decontaminate": {
            "enabled": True,
            "tasks": [{"config": str(tmp_path / "evalset.yaml"), "base_dir": str(tmp_path)}],
        },
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "encode": {"shard_documents": 20},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_corpus_path_is_the_decontaminated_output_when_that_stage_ran() -> None:
    assert corpus_path({"ingest": {"path": "/w/ingest/a"}}) == "/w/ingest/a"
    stages = {"ingest": {"path": "/w/ingest/a"}, "decontaminate": {"path": "/w/decontaminate/b"}}
    assert corpus_path(stages) == "/w/decontaminate/b"


@pytest.mark.slow
@pytest.mark.integration
def test_flows_report_the_stage_and_train_and_encode_the_decontaminated_corpus(
    recipe: Path, ray_session: str, prefect_api: str, mlflow_uri: str
) -> None:
    from pipelines.flows.encode_flow import encode_flow
    from pipelines.flows.tokenizer_flow import tokenizer_flow

    cfg = load_config(recipe)
    stages = tokenizer_flow(cfg)
    assert list(stages) == ["ingest", "decontaminate", "tokenizer"]
    clean = stages["decontaminate"]
    assert clean["stage"] == "decontaminate"
    assert not clean["reused"]
    assert Path(clean["path"]).parent == cfg.workspace / "decontaminate"
    clean_manifest = manifest(clean["path"])
    assert clean_manifest["decontamination"]["documents_removed"] == 1
    assert clean_manifest["decontaminated_from"] == stages["ingest"]["fingerprint"]
    [removed_id] = read_ipc_stream(Path(clean["path"]) / "removed.arrow")[schema.DOC_ID].to_pylist()

    tokenizer = manifest(stages["tokenizer"]["path"])
    assert tokenizer["ingest"]["path"] == clean["path"]
    assert tokenizer["metrics"]["documents"] == clean_manifest["splits"]["train"]["rows"]

    run = MlflowClient(mlflow_uri).get_run(clean["mlflow_run_id"])
    assert run.data.tags["lmpipe.stage"] == "decontaminate"
    assert run.data.params["decontaminate.n"] == "13"
    assert run.data.metrics["documents_removed"] == 1
    assert run.data.metrics["filtered.contaminated"] == 1
    assert run.data.metrics["kept"] == len(FILLER)

    encoded = encode_flow(cfg)
    assert all(encoded[s]["reused"] for s in ("ingest", "decontaminate", "tokenizer"))
    encode = manifest(encoded["encode"]["path"])
    assert encode["ingest"] == {"fingerprint": clean["fingerprint"], "path": clean["path"]}
    assert encode["metrics"]["documents"] == len(FILLER)
    ids = [
        doc_id
        for entry in encode["splits"].values()
        for shard in entry["shards"]
        for doc_id in read_ipc_stream(Path(encoded["encode"]["path"]) / shard["name"])[
            schema.DOC_ID
        ].to_pylist()
    ]
    assert removed_id not in ids
    assert len(ids) == len(FILLER)


@pytest.mark.slow
@pytest.mark.integration
def test_cli_summary_shows_removals_and_disabled_stage_leaves_the_flow_as_it_was(
    recipe: Path,
    ray_session: str,
    prefect_api: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rich.console import Console

    from pipelines.cli import main as cli
    from pipelines.flows.tokenizer_flow import tokenizer_flow

    monkeypatch.setattr(cli, "console", Console(width=300))  # no wrapped cells, whatever $COLUMNS
    assert main(["tokenizer", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "removed by evalset/validation" in out
    assert "filtered: contaminated" in out

    stages = tokenizer_flow(load_config(recipe, ["decontaminate.enabled=false"]))
    assert list(stages) == ["ingest", "tokenizer"]
    assert manifest(stages["tokenizer"]["path"])["ingest"]["path"] == stages["ingest"]["path"]
