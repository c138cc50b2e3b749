"""Secrets never reach logs, MLflow or Prefect: a canary through a real stage flow.

A unique canary is planted in every place a secret enters lmpipe: the config's `SecretStr`
fields (tracking password, Prefect API key, server auth string, admin password, database URLs,
fsspec storage options), credentials embedded in URL fields, and the environment variables the
clients read. The real `ingest` flow then runs on a tiny corpus under the session's Prefect API,
Ray and MLflow, and every output is searched: captured log records, stdout/stderr, the Prefect
flow run's parameters, logs and artifacts, the MLflow runs' params, tags and artifacts, both
databases' files and every file written in the workspace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipelines.config import ConfigError, RunConfig, load_config
from tasks.common.io import public_dump, redact_url

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.integration]

ENV_SECRETS = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "PREFECT_API_KEY")


@pytest.fixture
def canary() -> str:
    return f"CANARY{uuid.uuid4().hex}"


def planted_config(canary: str, tmp_path: Path, mlflow_uri: str) -> RunConfig:
    """A run config with the canary in every secret field, and `ctl<canary>` in a public one.

    The control value (the source's name) must be found where the canary must not: it shows
    that each search looks where a leaked secret would be.
    """
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as handle:
        for i in range(40):
            handle.write(json.dumps({"text": f"Document {i} says something about topic {i}."}))
            handle.write("\n")
    return RunConfig.model_validate(
        {
            "name": "secrets",
            "workspace": str(tmp_path / "ws"),
            "ray": {"num_workers": 2, "num_cpus": 4},
            "prefect": {"api_key": f"{canary}-prefect-key", "retries": 0},
            "tracking": {
                "tracking_uri": mlflow_uri,
                "experiment": f"secrets-{canary[-8:]}",
                "username": "lmpipe",
                "password": f"{canary}-tracking-password",
            },
            "servers": {
                "prefect_auth_string": f"admin:{canary}-auth",
                "mlflow_admin_password": f"{canary}-admin",
                "prefect_database_url": f"postgresql+asyncpg://u:{canary}-pg@db/prefect",
                "mlflow_backend_store_uri": f"postgresql://u:{canary}-pg2@db/mlflow",
            },
            "ingest": {
                "sources": [
                    {
                        "path": str(corpus),
                        "name": f"ctl{canary}",
                        "format": "jsonl",
                        "storage_options": {"token": f"{canary}-storage"},
                    }
                ],
                "split": {"validation": 0.1, "test": 0.1},
            },
        }
    )


def files_with(root: Path, canary: str) -> list[str]:
    """Every file under `root` whose bytes contain the canary (the control value aside)."""
    needle, control = canary.encode(), f"ctl{canary}".encode()
    hits = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            try:
                if needle in path.read_bytes().replace(control, b""):
                    hits.append(str(path))
            except OSError:
                continue
    return hits


async def prefect_records(flow_run_id: Any) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    # Run logs reach the API from a background worker, in batches: under a loaded test session
    # they may not be there yet. Drain it, then read (bounded: about 30 s at most).
    await APILogHandler.aflush()
    async with get_client() as client:
        run = await client.read_flow_run(flow_run_id)
        log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        logs = await client.read_logs(log_filter, limit=200)
        for _ in range(60):
            if logs:
                break
            await asyncio.sleep(0.5)
            logs = await client.read_logs(log_filter, limit=200)
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        tasks = await client.read_task_runs()
    return {
        "parameters": run.parameters,
        "logs": [log.message for log in logs],
        "artifacts": [(a.key, a.description, a.data) for a in artifacts],
        "task_runs": [t.model_dump(mode="json") for t in tasks if t.flow_run_id == flow_run_id],
    }


def mlflow_records(uri: str, experiment: str, dst: Path) -> dict[str, Any]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert runs, "the flow logged no MLflow run"
    for run in runs:
        client_dst = dst / run.info.run_id
        client_dst.mkdir(parents=True)
        import mlflow.artifacts

        mlflow.artifacts.download_artifacts(
            run_id=run.info.run_id, dst_path=str(client_dst), tracking_uri=uri
        )
    return {
        "params": [run.data.params for run in runs],
        "tags": [run.data.tags for run in runs],
        "runs": len(runs),
    }


def test_canary_secrets_never_leave_the_process(
    canary: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    ray_session: str,
    prefect_api: str,
    mlflow_uri: str,
) -> None:
    from prefect.settings import get_current_settings

    from pipelines.flows.ingest_flow import ingest_flow

    for name in ENV_SECRETS:
        monkeypatch.setenv(name, f"{canary}-env-{name}")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "lmpipe")
    cfg = planted_config(canary, tmp_path, mlflow_uri)
    caplog.set_level(logging.DEBUG)

    state = ingest_flow(cfg, return_state=True)
    assert state.is_completed(), state.message
    out, err = capfd.readouterr()

    flow_run_id = state.state_details.flow_run_id
    prefect = asyncio.run(prefect_records(flow_run_id))
    mlflow = mlflow_records(mlflow_uri, cfg.tracking.experiment, tmp_path / "mlflow-artifacts")
    assert prefect["logs"], "no Prefect run logs to search"
    assert any(mlflow["params"]), "no MLflow params to search"

    searched = {
        "log records": [r.getMessage() for r in caplog.records] + [r.msg for r in caplog.records],
        "stdout": out,
        "stderr": err,
        "prefect flow parameters": prefect["parameters"],
        "prefect run logs": prefect["logs"],
        "prefect artifacts": prefect["artifacts"],
        "prefect task runs": prefect["task_runs"],
        "mlflow params": mlflow["params"],
        "mlflow tags": mlflow["tags"],
    }
    dumps = {where: json.dumps(value, default=str) for where, value in searched.items()}
    leaks = [where for where, text in dumps.items() if canary in text.replace(f"ctl{canary}", "")]
    for where in ("prefect flow parameters", "mlflow params"):
        assert f"ctl{canary}" in dumps[where], f"the search of {where} would miss a leak"
    url = get_current_settings().server.database.connection_url
    assert url is not None
    database = Path(str(url.get_secret_value()).split("///")[-1])
    mlflow_db = Path(mlflow_uri.removeprefix("sqlite:///"))
    leaks += files_with(tmp_path / "ws", canary)
    leaks += files_with(tmp_path / "mlflow-artifacts", canary)
    leaks += files_with(database.parent, canary)
    leaks += files_with(mlflow_db.parent, canary)
    leaks += files_with(Path(os.environ["PREFECT_HOME"]), canary)
    assert leaks == []
    for root in (tmp_path / "ws", mlflow_db.parent, database.parent):
        assert files_with(root, f"ctl{canary}"), f"the search of {root} would miss a leak"
    # The secrets did reach the one place they are for: the clients' environment.
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == f"{canary}-tracking-password"
    assert (tmp_path / "ws" / "ingest").is_dir()


def test_public_dump_keeps_secret_names_not_values(canary: str, tmp_path: Path) -> None:
    cfg = planted_config(canary, tmp_path, "sqlite:///x.db")
    dumped = json.dumps(public_dump(cfg), default=str).replace(f"ctl{canary}", "")
    assert canary not in dumped
    assert "token" in dumped  # which storage option was set stays visible
    assert canary not in repr(cfg).replace(f"ctl{canary}", "")
    assert canary not in str(cfg).replace(f"ctl{canary}", "")


@pytest.mark.parametrize(
    "key",
    ["tracking.tracking_uri", "tracking.ui_url", "prefect.api_url", "servers.prefect_ui_api_url"],
)
def test_passwords_inside_url_fields_are_refused(canary: str, tmp_path: Path, key: str) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: secrets\n")
    url = f"http://lmpipe:{canary}@127.0.0.1:5000"
    with pytest.raises(ConfigError) as caught:
        load_config(recipe, [f"{key}={url}"])
    assert key in str(caught.value)
    assert canary not in str(caught.value)  # the refusal does not echo it either


def test_redact_url_hides_only_the_password() -> None:
    assert redact_url("https://u:p4ss@host:5000/x") == "https://u:***@host:5000/x"
    assert redact_url("postgresql+asyncpg://u:p@db/x") == "postgresql+asyncpg://u:***@db/x"
    assert redact_url("http://127.0.0.1:4200/api") == "http://127.0.0.1:4200/api"
    assert redact_url("sqlite:////abs/mlflow.db") == "sqlite:////abs/mlflow.db"
    assert (
        redact_url("see http://a:b@h and s3://k:s@bucket")
        == "see http://a:***@h and s3://k:***@bucket"
    )


def test_environment_urls_with_credentials_are_redacted_in_records(
    canary: str, tmp_path: Path
) -> None:
    # MLFLOW_TRACKING_URI may carry credentials; what the config records hides them.
    cfg = RunConfig(name="x", workspace=tmp_path)
    with_env = cfg.model_copy(
        update={
            "tracking": cfg.tracking.model_copy(
                update={"tracking_uri": f"https://lmpipe:{canary}@mlflow.example"}
            )
        }
    )
    dumped = json.dumps(public_dump(with_env), default=str)
    assert canary not in dumped
    assert "https://lmpipe:***@mlflow.example" in dumped
