"""The finetune, compare and evaluate flows under a real Prefect API, Ray and MLflow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines.config import ConfigError, load_config

pytestmark = [pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[3]


def recipe(tmp_path: Path, mlflow_uri: str, shared_data: Path, base: Path, **sections: Any) -> Path:
    config = {
        "name": "ft",
        "workspace": str(tmp_path / "ws"),
        "tracking": {
            "tracking_uri": mlflow_uri,
            "experiment": f"flows-{tmp_path.name}",
            "system_metrics_interval_s": 0.5,  # a sample even from a run of a few seconds
        },
        "ray": {"num_workers": 2, "num_cpus": 4},
        "task": {"config": str(REPO / "configs/tasks/cola.yaml"), "base_dir": str(shared_data)},
        "finetune": {
            "base": {"path": str(base)},
            "epochs": 2,
            "batch_size": 16,
            "micro_batch_size": 16,
            "lr": 0.001,
            "features": {"max_length": 64, "stride": 16},
        },
        **sections,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def capped(train: int = 64, held: int = 32) -> list[str]:
    """Overrides that cap every split of the task (fast flows on the real CoLA files)."""
    return [f"task.max_examples={{train: {train}, validation: {held}, test: {held}}}"]


def test_finetune_flow_on_cola_registers_the_model_with_a_report(
    prefect_api: str,
    ray_session: str,
    mlflow_uri: str,
    shared_data: Path,
    tiny_base_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    from mlflow.tracking import MlflowClient

    from pipelines.flows.finetune_flow import finetune_flow

    path = recipe(tmp_path, mlflow_uri, shared_data, tiny_base_models["bert"])
    cfg = load_config(path, capped())
    stages = finetune_flow(cfg)
    assert stages["downstream"]["splits"]["train"]["rows"] == 64
    result = stages["finetune"]
    assert "mcc" in result["test"]
    assert result["model_name"] == "ft-cola"
    client = MlflowClient(mlflow_uri)
    version = client.get_model_version("ft-cola", result["model_version"])
    assert version.tags["base_model_path"] == str(tiny_base_models["bert"].resolve())
    report = Path(result["run_dir"]) / "report" / "report.md"
    assert "Test metrics" in report.read_text()
    # Lineage in MLflow: the model version's run read the task data and the base model, and
    # the task data's run read the CoLA source files.
    run = client.get_run(version.run_id)
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"downstream", "base_model"}
    task = stages["downstream"]
    assert inputs["downstream"].dataset.digest == task["fingerprint"]
    assert json.loads(inputs["downstream"].dataset.source) == {"uri": task["path"]}
    assert len(inputs["base_model"].dataset.digest) == 16
    assert {t.value for t in inputs["downstream"].tags} == {"training"}
    assert "system/cpu_utilization_percentage" in run.data.metrics
    sources = client.get_run(task["mlflow_run_id"]).inputs.dataset_inputs
    assert {json.loads(i.dataset.source)["uri"] for i in sources} == {
        str(shared_data / path) for path in task["inputs"]
    }
    assert all(len(i.dataset.digest) == 36 for i in sources)  # sha256, cut to MLflow's limit


def test_compare_flow_reports_mean_and_spread_over_seeds_in_one_experiment(
    prefect_api: str,
    ray_session: str,
    mlflow_uri: str,
    shared_data: Path,
    tiny_base_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    from mlflow.tracking import MlflowClient

    from pipelines.flows.compare_flow import compare_flow

    entries = [{"strategy": {"name": "feature_extraction"}}, {"strategy": {"name": "lora"}}]
    path = recipe(
        tmp_path,
        mlflow_uri,
        shared_data,
        tiny_base_models["bert"],
        compare={"entries": entries, "seeds": [0, 1], "experiment": "compare-test"},
    )
    out = compare_flow(load_config(path, capped(train=32, held=16)))
    rows = {row["strategy"]: row for row in out["compare"]["rows"]}
    assert set(rows) == {"feature_extraction", "lora"}
    for row in rows.values():
        assert len(row["values"]) == 2
        assert row["mean"] == pytest.approx(sum(row["values"]) / 2)
    assert (
        rows["lora"]["trainable_parameters"] != rows["feature_extraction"]["trainable_parameters"]
    )
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("compare-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 5  # 2 strategies x 2 seeds, plus the summary run
    (summary_run,) = [r for r in runs if r.data.tags.get("stage") == "compare"]
    (task_input,) = client.get_run(summary_run.info.run_id).inputs.dataset_inputs
    assert task_input.dataset.digest == out["downstream"]["fingerprint"]
    table = (Path(out["compare"]["report_dir"]) / "comparison.md").read_text()
    assert "feature_extraction" in table
    assert "lora" in table


def test_evaluate_flow_prompts_a_gpt_model_zero_and_few_shot(
    prefect_api: str,
    mlflow_uri: str,
    shared_data: Path,
    tiny_base_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    from pipelines.flows.evaluate_flow import evaluate_flow
    from tasks.common import schema
    from tasks.common.io import read_downstream_dir
    from training.evaluate.prompting import classify_by_prompting
    from training.models.export import load_export

    prompting = {
        "template": "Review: {text}\nSentiment:",
        "verbalizers": {"negative": " bad", "positive": " good"},
        "k_shot": 2,
    }
    path = recipe(
        tmp_path,
        mlflow_uri,
        shared_data,
        tiny_base_models["gpt2"],
        evaluate={"prompting": prompting, "split": "validation", "max_examples": 12},
    )
    imdb = [
        "task.config=" + str(REPO / "configs/tasks/imdb.yaml"),
        "task.max_examples={train: 32, validation: 16}",
    ]
    cfg = load_config(path, imdb)
    stages = evaluate_flow(cfg)
    out = stages["evaluate"]
    assert out["prompting"]["k_shot"] == 2
    assert out["prompting"]["examples"] == 12
    assert 0.0 <= out["prompting"]["metrics"]["accuracy"] <= 1.0
    # The reported accuracy is the share of the 12 validation rows whose likeliest verbalizer
    # is the gold label: recomputed here from the same model, rows and demonstrations.
    prompt_cfg = cfg.evaluate.prompting
    assert prompt_cfg is not None
    manifest, tables = read_downstream_dir(Path(stages["downstream"]["path"]))
    rows = tables["validation"].slice(0, 12)
    labels = [str(x) for x in manifest["labels"]]
    model, tok = load_export(tiny_base_models["gpt2"], "gpt2")
    scored = classify_by_prompting(model, tok, rows, labels, prompt_cfg, tables["train"])
    correct = scored.predictions == rows.column(schema.LABEL).to_numpy()
    assert out["prompting"]["metrics"]["accuracy"] == pytest.approx(correct.mean())
    assert len(out["generation"]) == 4  # one prompt x four decoding settings
    saved = json.loads((Path(out["report_dir"]) / "evaluation.json").read_text())
    assert saved["prompting"] == out["prompting"]


def test_finetune_without_a_task_is_refused_before_any_work(
    mlflow_uri: str, shared_data: Path, tiny_base_models: dict[str, Path], tmp_path: Path
) -> None:
    from pipelines.flows.finetune_flow import prepare_task

    path = recipe(tmp_path, mlflow_uri, shared_data, tiny_base_models["bert"])
    cfg = load_config(path).model_copy(update={"task": None})
    with pytest.raises(ConfigError, match="needs a `task` section"):
        prepare_task(cfg)


def test_a_missing_task_file_is_named_when_the_config_loads(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"task": {"config": str(tmp_path / "nope.yaml")}}))
    with pytest.raises(ConfigError, match=r"nope\.yaml"):
        load_config(path)
