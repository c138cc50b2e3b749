"""One run lifecycle (`tracked_run`) on a real MLflow SQLite store, its inputs and system metrics.

Cheap on purpose: no training. The comparison and evaluation stages are driven through the
smallest function around their run, with a fault that raises inside it (and the evaluation once
with a stand-in result, for its params).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prefect.logging import disable_run_logger

from tasks.common.ray_runtime import RayConfig
from training.runtime.run_context import RunContext
from training.tracking.runs import DatasetRef, TrackingConfig, output_ref, tracked_run

pytestmark = pytest.mark.slow  # MLflow


def tracking(mlflow_uri: str, request: pytest.FixtureRequest, **extra: Any) -> TrackingConfig:
    """A tracking section on the session store, in an experiment of this test's own."""
    return TrackingConfig(tracking_uri=mlflow_uri, experiment=f"t-{request.node.name}", **extra)


def context(cfg: TrackingConfig, workspace: Path, name: str) -> RunContext:
    """A run context of seed 0 on a local Ray, tracked with `cfg`."""
    return RunContext(workspace, seed=0, ray=RayConfig(), tracking=cfg, name=name)


def only_run(mlflow_uri: str, cfg: TrackingConfig) -> Any:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name(cfg.experiment)
    (run,) = client.search_runs([experiment.experiment_id])
    return run


def test_tracked_run_ends_finished_and_logs_its_dataset_inputs(
    mlflow_uri: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    out = tmp_path / "examples"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"stage": "examples", "fingerprint": "ab12"}))
    cfg = tracking(mlflow_uri, request)
    with tracked_run(cfg, tmp_path, "r-stage", {"stage": "x"}) as tracker:
        tracker.log_inputs(
            [output_ref("examples", out, "training"), DatasetRef("m", "9" * 64, "s")]
        )
    run = MlflowClient(mlflow_uri).get_run(str(tracker.run_id))
    assert (run.info.status, run.info.run_name) == ("FINISHED", "r-stage")
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    assert inputs["examples"].dataset.digest == "ab12"
    assert json.loads(inputs["examples"].dataset.source) == {"uri": str(out)}
    assert {t.key: t.value for t in inputs["examples"].tags} == {"mlflow.data.context": "training"}
    assert inputs["m"].dataset.digest == "9" * 36  # MLflow's limit


@pytest.mark.parametrize(
    ("error", "status"), [(RuntimeError, "FAILED"), (KeyboardInterrupt, "KILLED")]
)
def test_tracked_run_marks_a_raising_body_and_reraises(
    error: type[BaseException],
    status: str,
    mlflow_uri: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    cfg = tracking(mlflow_uri, request)
    with pytest.raises(error), tracked_run(cfg, tmp_path, "r", {}):
        raise error("boom")
    assert only_run(mlflow_uri, cfg).info.status == status


def test_tracked_run_resumes_a_run_and_ends_it_as_the_body_says(
    mlflow_uri: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    cfg = tracking(mlflow_uri, request)
    with tracked_run(cfg, tmp_path, "r", {}) as first:
        first.end_status = "KILLED"  # stopped early, as a pretraining run at `stop_at_step`
    assert only_run(mlflow_uri, cfg).info.status == "KILLED"
    with tracked_run(cfg, tmp_path, "ignored", {}, run_id=first.run_id) as second:
        assert only_run(mlflow_uri, cfg).info.status == "RUNNING"
    assert second.run_id == first.run_id
    assert only_run(mlflow_uri, cfg).info.status == "FINISHED"


def test_tracked_run_with_tracking_off_records_nothing(tmp_path: Path) -> None:
    cfg = TrackingConfig(enabled=False, tracking_uri=f"sqlite:///{tmp_path / 'never.db'}")
    with tracked_run(cfg, tmp_path, "r", {}, system_metrics=True) as tracker:
        tracker.log_inputs([DatasetRef("x", "1", "y")])
    assert tracker.run_id is None
    assert not (tmp_path / "never.db").exists()


def test_system_metrics_are_sampled_into_a_training_run(
    mlflow_uri: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    cfg = tracking(mlflow_uri, request, system_metrics_interval_s=0.1)
    with tracked_run(cfg, tmp_path, "r", {}, system_metrics=True):
        time.sleep(0.5)
    metrics = only_run(mlflow_uri, cfg).data.metrics
    assert "system/cpu_utilization_percentage" in metrics
    assert "system/system_memory_usage_megabytes" in metrics


def test_a_run_shorter_than_one_interval_still_gets_its_sample(
    mlflow_uri: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """MLflow's monitor logs a sample only after an interval; the last one is logged at the end."""
    cfg = tracking(mlflow_uri, request, system_metrics_interval_s=30.0)
    started = time.monotonic()
    with tracked_run(cfg, tmp_path, "r", {}, system_metrics=True):
        pass
    assert time.monotonic() - started < 20  # the end does not wait for the interval
    metrics = only_run(mlflow_uri, cfg).data.metrics
    assert "system/cpu_utilization_percentage" in metrics


def test_a_training_run_without_psutil_runs_without_system_metrics(
    mlflow_uri: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None in sys.modules makes the import raise ImportError, as a missing psutil does.
    monkeypatch.setitem(sys.modules, "mlflow.system_metrics.system_metrics_monitor", None)
    cfg = tracking(mlflow_uri, request, system_metrics_interval_s=0.1)
    with tracked_run(cfg, tmp_path, "r", {}, system_metrics=True):
        time.sleep(0.2)
    run = only_run(mlflow_uri, cfg)
    assert run.info.status == "FINISHED"
    assert not [k for k in run.data.metrics if k.startswith("system/")]


def test_a_comparison_run_that_raises_ends_failed(
    mlflow_uri: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from training.finetune import compare

    missing = tmp_path / "gone.md"  # logging it raises inside the run
    monkeypatch.setattr(compare, "comparison_report", lambda *a: ([missing], "table"))
    row = {"strategy": "lora", "mean": 0.5, "std": 0.1, "trainable_parameters": 8}
    cfg = tracking(mlflow_uri, request)
    with pytest.raises(OSError, match="gone"):
        compare.log_comparison(
            [row | {"train_time_s": 1.0}], "mcc", tmp_path, run=context(cfg, tmp_path, "c")
        )
    run = only_run(mlflow_uri, cfg)
    assert (run.info.status, run.info.run_name) == ("FAILED", "c-compare")
    assert run.data.metrics["lora_mcc_mean"] == 0.5


@pytest.mark.filterwarnings("ignore:Artifact creation outside:FutureWarning")  # no flow run here
def test_an_evaluation_run_logs_its_section_and_what_it_evaluated_as_params(
    prefect_api: str,
    mlflow_uri: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from training.evaluate import stage
    from training.evaluate.config import EvaluateConfig

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    done = {"family": "gpt2", "model_dir": str(model), "heldout": {"loss": 2.5}}
    monkeypatch.setattr(stage, "evaluate_model", lambda *a, **k: dict(done))
    tuned = {"run_dir": "/runs/ab12", "export_dir": "/runs/ab12/export", "test": {"mcc": 0.5}}
    tuned |= {"model_name": "t-cola", "model_version": "3"}
    cfg = tracking(mlflow_uri, request)
    with disable_run_logger():
        stage.evaluate_task.fn(
            str(model), EvaluateConfig(), run=context(cfg, tmp_path, "e"), finetuned=tuned
        )
    run = only_run(mlflow_uri, cfg)
    params = run.data.params
    assert params["evaluate.split"] == "test"
    assert params["evaluate.intrinsic.top_k"] == "5"
    assert (params["model_dir"], params["family"], params["seed"]) == (str(model), "gpt2", "0")
    assert params["finetuned_model"] == "t-cola/3"
    assert params["finetuned_export"] == "/runs/ab12/export"
    assert "examples" not in params  # nothing of what it did not read
    assert run.data.metrics == {"heldout_loss": 2.5, "finetuned_test_mcc": 0.5}


def test_an_evaluation_run_that_raises_ends_failed(
    mlflow_uri: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from training.evaluate import stage
    from training.evaluate.config import EvaluateConfig

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    bad = {"family": "gpt2", "model_dir": str(model), "heldout": {"loss": "not a number"}}
    monkeypatch.setattr(stage, "evaluate_model", lambda *a, **k: dict(bad))
    cfg = tracking(mlflow_uri, request)
    with disable_run_logger(), pytest.raises(ValueError, match="not a number"):
        stage.evaluate_task.fn(str(model), EvaluateConfig(), run=context(cfg, tmp_path, "e"))
    run = only_run(mlflow_uri, cfg)
    assert (run.info.status, run.info.run_name) == ("FAILED", "e-evaluate")
    (model_input,) = run.inputs.dataset_inputs
    assert model_input.dataset.name == "model"
    assert not list((tmp_path / "evaluate").glob("*/manifest.json"))  # no evaluation kept
