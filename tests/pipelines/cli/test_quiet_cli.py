"""A quiet terminal (issue 40): no HTTP client's log record below WARNING unless `--verbose`.

`lmpipe examples inspect` and a short `lmpipe finetune` run in this process (`main`, as
`tests/pipelines/test_cli_answers.py` runs it) against the session's Prefect API, Ray and MLflow
store, while a handler on the root logger keeps every record. The root logger is at DEBUG here,
so a client left at its default level would be caught; `--verbose` is the control: the same
inspect then yields httpx's request records. The fine-tuning runs in this process
(`launcher: in_process`), so its worker's records are kept too; its base model is the session's
tiny BERT, so no pretraining runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines.cli.main import HTTP_LOGGERS, main

pytestmark = [pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[3]


class Keep(logging.Handler):
    """Keep every record that reaches it."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """Every record logged while the test runs; the logger levels `main` sets are put back."""
    root = logging.getLogger()
    loggers = [root, *(logging.getLogger(name) for name in HTTP_LOGGERS)]
    levels = [logger.level for logger in loggers]
    keep = Keep()
    root.addHandler(keep)
    root.setLevel(logging.DEBUG)
    try:
        yield keep.records
    finally:
        root.removeHandler(keep)
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def http_below_warning(records: list[logging.LogRecord]) -> list[str]:
    """The records of the HTTP clients (or their child loggers) below WARNING, as text."""
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in records
        if r.name.split(".")[0] in HTTP_LOGGERS and r.levelno < logging.WARNING
    ]


def api_log_messages(records: list[logging.LogRecord]) -> list[str]:
    """What Prefect's API holds of the flow runs these records came from: their log lines."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=5)  # it sends in batches
    runs = sorted({str(r.flow_run_id) for r in records if getattr(r, "flow_run_id", None)})
    assert runs, "no record named its flow run"
    with get_client(sync_client=True) as client:
        found = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=runs)))
    return [entry.message for entry in found]


def recipe(tmp_path: Path, demo: Any, tiny_bert: Path, mlflow_uri: str) -> Path:
    """The session's demo examples (linked in: cache hits), a tiny BERT fine-tuned in-process."""
    demo.examples("bert")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    for stage in ("ingest", "tokenizer", "encode", "examples"):
        (workspace / stage).symlink_to(demo.root / "ws" / stage)
    config: dict[str, Any] = {
        "name": "quiet",
        "workspace": str(workspace),
        "tracking": {"tracking_uri": mlflow_uri, "experiment": f"quiet-{tmp_path.name}"},
        # As `DemoData` built them, so that every data stage is a cache hit.
        "ingest": {
            "sources": [{"path": str(demo.root / "corpus" / "corpus"), "format": "jsonl"}],
            "split": {"validation": 0.05, "test": 0.05},
        },
        "tokenizer": {"family": "wordpiece", "vocab_size": 1024, "model_max_length": 512},
        "examples": {"objective": "bert", "max_seq_length": 64, "block_size": 64},
        "task": {
            "config": str(REPO / "configs/tasks/demo_residence.yaml"),
            "base_dir": str(demo.root / "corpus"),
            "max_examples": {"train": 16, "validation": 8, "test": 8},
        },
        "finetune": {
            "base": {"path": str(tiny_bert)},
            "epochs": 1,
            "batch_size": 8,
            "micro_batch_size": 8,
            "register_model": False,
            "features": {"max_length": 32, "stride": 8},
            "scale": {"num_workers": 1, "launcher": "in_process", "max_failures": 0},
        },
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_examples_inspect_logs_no_http_request_below_warning_unless_verbose(
    records: list[logging.LogRecord],
    tmp_path: Path,
    ray_session: str,
    prefect_api: str,
    mlflow_uri: str,
    demo_data: Any,
    tiny_base_models: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = recipe(tmp_path, demo_data, tiny_base_models["bert"], mlflow_uri)
    command = ["examples", "inspect", str(path), f"ray.address={ray_session}", "--count", "1"]
    assert main(command) == 0, capsys.readouterr().err[-3000:]
    assert capsys.readouterr().out.strip()  # the decoded example
    assert http_below_warning(records) == []
    # Prefect's own records still reach its API (the UI's flow run logs).
    assert any(m.startswith("Finished in state") for m in api_log_messages(records))

    records.clear()
    assert main(["--verbose", *command]) == 0, capsys.readouterr().err[-3000:]
    requests = http_below_warning(records)
    assert any(line.startswith("INFO httpx: HTTP Request: ") for line in requests), requests


def test_a_short_finetune_logs_no_http_request_below_warning(
    records: list[logging.LogRecord],
    tmp_path: Path,
    ray_session: str,
    prefect_api: str,
    mlflow_uri: str,
    demo_data: Any,
    tiny_base_models: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = recipe(tmp_path, demo_data, tiny_base_models["bert"], mlflow_uri)
    code = main(["finetune", str(path), f"ray.address={ray_session}"])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert any(r.name == "training.finetune.loop" for r in records)  # the worker's: kept too
    assert http_below_warning(records) == []
