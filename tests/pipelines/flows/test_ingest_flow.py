"""`lmpipe ingest` end to end: the CLI runs the Prefect flow (session API), Ray and MLflow."""

import json
import re
from pathlib import Path

import datasets
import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines.cli.main import main
from tasks.common.io import read_ipc_stream

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def count_blocks(path: Path) -> int:
    """Count blank-line-separated blocks by walking lines (independent of the code under test)."""
    blocks, in_block = 0, False
    for line in path.read_bytes().split(b"\n"):
        blank = line.strip(b" \t\r\f\v") == b""
        blocks += not blank and not in_block
        in_block = not blank
    return blocks


def count_lines(path: Path) -> int:
    return sum(1 for line in path.read_bytes().split(b"\n") if line.strip())


def test_lmpipe_ingest_over_shared_corpora(
    shared_data: Path, tmp_path: Path, ray_session: str, prefect_api: str, mlflow_uri: str
) -> None:
    books = sorted((shared_data / "gutenberg_books").glob("*.txt"))
    shakespeare = shared_data / "tiny_shakespeare" / "input.txt"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "shared-corpora",
                "workspace": str(tmp_path / "ws"),
                "tracking": {"tracking_uri": mlflow_uri, "experiment": "ingest-acceptance"},
                "ingest": {
                    "sources": [
                        {
                            "path": str(shared_data / "gutenberg_books"),
                            "name": "books",
                            "txt_mode": "block",
                        },
                        {"path": str(shakespeare), "name": "shakespeare", "txt_mode": "line"},
                    ]
                },
            }
        )
    )
    assert main(["ingest", str(recipe), "ingest.shard_size_mb=0.5"]) == 0

    [manifest_path] = (tmp_path / "ws" / "ingest").glob("*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    counts = manifest["counts"]
    expected_read = sum(count_blocks(b) for b in books) + count_lines(shakespeare)
    assert counts["read"] == expected_read
    assert counts["read"] == (
        counts["kept"]
        + sum(counts["filtered"].values())
        + sum(counts["duplicates"].values())
        + sum(counts["quarantined"].values())
    )
    assert manifest["schema_version"] == 1
    assert {i["rel"] for i in manifest["inputs"]} == {b.name for b in books} | {"input.txt"}

    rows = 0
    for split, entry in manifest["splits"].items():
        for shard in entry["shards"]:
            path = manifest_path.parent / shard["name"]
            table = read_ipc_stream(path)
            assert table.num_rows == shard["rows"]
            assert path.stat().st_size == shard["bytes"]
            dataset = datasets.Dataset.from_file(str(path))
            assert dataset.num_rows == table.num_rows
            assert dataset[0]["doc_id"] == table.column("doc_id")[0].as_py()
            for text, sentences in zip(
                table.column("text").to_pylist(), table.column("sentences").to_pylist(), strict=True
            ):
                assert " ".join(" ".join(s.split()) for s in sentences) == " ".join(text.split())
            rows += table.num_rows
            assert split in ("train", "validation", "test")
    assert rows == counts["kept"]
    assert manifest["splits"]["validation"]["rows"] > 0

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("ingest-acceptance")
    [run] = client.search_runs([experiment.experiment_id], "tags.`lmpipe.stage` = 'ingest'")
    assert run.info.status == "FINISHED"
    assert run.data.params["ingest.shard_size_mb"] == "0.5"
    assert run.data.metrics["read"] == expected_read
    assert run.data.metrics["kept"] == counts["kept"]
    local = client.download_artifacts(run.info.run_id, "manifest/manifest.json", str(tmp_path))
    assert json.loads(Path(local).read_text())["fingerprint"] == manifest["fingerprint"]
    assert re.fullmatch(r"[0-9a-f]{16}", manifest["fingerprint"])
