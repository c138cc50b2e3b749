"""Fine-tuning end to end: every task type on the real shared sets, on Ray, in MLflow.

The worker loop (`run_finetune_worker`, the function Ray Train runs on each worker) is driven
in-process for each task type on a tiny model; one run goes through Ray Train with two DDP
workers, one through DeepSpeed, and one through `finetune_stage` with MLflow and the registry.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers as tf

from tasks.common.ray_runtime import RayConfig
from tasks.downstream.config import load_dataset_config
from tasks.downstream.stage import prepare_downstream
from training.finetune.config import FinetuneConfig
from training.finetune.evaluation import Evaluator
from training.finetune.loop import FinetuneJob, epoch_metrics, run_finetune_worker
from training.finetune.stage import finetune_stage, model_fingerprint, run_finetune
from training.runtime.run_context import RunContext
from training.runtime.worker_context import LocalContext
from training.tracking.runs import TrackingConfig

REPO = Path(__file__).resolve().parents[3]
# (task config, family, metric that must be reported): every task type on real data.
TASKS = [
    ("cola", "bert", "mcc"),
    ("imdb", "bert", "auc_roc"),
    ("mrpc", "bert", "f1_macro"),
    ("stsb", "bert", "spearman"),
    ("conll", "bert", "entity_f1"),
    ("squad", "bert", "exact_match"),
    ("xsum", "t5", "rougeL"),
    ("xsum", "bart", "rougeL"),  # BART fine-tunes for summarization
    ("cola", "electra", "mcc"),  # the exported ELECTRA discriminator classifies
    ("wmt16", "t5", "bleu"),
    ("instructions", "gpt2", "perplexity"),
]


def prepared(name: str, shared_data: Path, out: Path, train: int = 48, held: int = 16) -> Path:
    cfg = load_dataset_config(REPO / "configs" / "tasks" / f"{name}.yaml")
    caps = {"train": train, "validation": held, "test": held}
    cfg = cfg.model_copy(
        update={"max_examples": {k: v for k, v in caps.items() if k in cfg.split_names()}}
    )
    prepare_downstream(cfg, shared_data, out)
    return out


def finetune_cfg(**extra: Any) -> FinetuneConfig:
    base = {
        "epochs": 2,
        "batch_size": 8,
        "micro_batch_size": 8,
        "lr": 1e-3,
        "features": {"max_length": 128, "stride": 16},
        "generation": {"max_new_tokens": 8},
    }
    return FinetuneConfig.model_validate(base | extra)


def no_tracking(workspace: Path) -> RunContext:
    """Seed 0, two workers on the session's Ray, no MLflow."""
    ray_cfg = RayConfig(num_workers=2, num_cpus=4)
    return RunContext(
        workspace, seed=0, ray=ray_cfg, tracking=TrackingConfig(enabled=False), name="t"
    )


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize(("task", "family", "metric"), TASKS)
def test_each_task_type_fine_tunes_on_its_real_data_and_reports_metrics(
    task: str,
    family: str,
    metric: str,
    tiny_base_models: dict[str, Path],
    shared_data: Path,
    tmp_path: Path,
) -> None:
    data = prepared(task, shared_data, tmp_path / "data")
    job = FinetuneJob(
        finetune=finetune_cfg(source_prefix="summarize: " if family == "t5" else ""),
        seed=0,
        data_dir=data,
        model_dir=tiny_base_models[family],
        config_hash="t",
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = run_finetune_worker(job, LocalContext(run_dir))
    assert result["epochs_run"] == 2
    assert [row["epoch"] for row in result["history"]] == [0, 1]
    held_out = result["test"] or result["validation"]
    assert metric in held_out
    assert held_out[metric] == held_out[metric] or metric == "spearman"  # NaN only if constant
    on_disk = json.loads((run_dir / "result.json").read_text())
    assert on_disk["best_epoch"] == result["best_epoch"]
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["model_type"] == family


@pytest.mark.slow
@pytest.mark.integration
def test_two_ddp_workers_on_ray_train_fine_tune_and_agree_on_early_stopping(
    ray_session: str, tiny_base_models: dict[str, Path], shared_data: Path, tmp_path: Path
) -> None:
    data = prepared("cola", shared_data, tmp_path / "data", train=64)
    cfg = finetune_cfg(
        epochs=3,
        batch_size=16,
        scale={"num_workers": 2, "max_failures": 0},
        early_stopping={"patience": 1},
    )
    ctx = no_tracking(tmp_path)
    run = run_finetune(cfg, data, tiny_base_models["bert"], tmp_path / "runs", run=ctx)
    assert 1 <= run.result["epochs_run"] <= 3
    history = [json.loads(x) for x in (run.run_dir / "history.jsonl").read_text().splitlines()]
    assert len(history) == run.result["epochs_run"]  # rank 0 logged every epoch exactly once
    model = tf.AutoModelForSequenceClassification.from_pretrained(run.export_dir)
    assert model.config.num_labels == 2
    again = run_finetune(cfg, data, tiny_base_models["bert"], tmp_path / "runs", run=ctx)
    assert again.run_dir == run.run_dir  # same inputs: the finished run is reused
    assert again.result == run.result


@pytest.mark.slow
@pytest.mark.integration
def test_deepspeed_progressive_unfreezing_on_ray_keeps_frozen_layers_until_their_stage(
    ray_session: str, tiny_base_models: dict[str, Path], shared_data: Path, tmp_path: Path
) -> None:
    data = prepared("cola", shared_data, tmp_path / "data", train=32)
    cfg = finetune_cfg(
        epochs=2,
        deepspeed=True,
        zero_stage=2,
        strategy={"name": "progressive_unfreezing"},
        early_stopping=None,
    )
    ctx = no_tracking(tmp_path)
    run = run_finetune(cfg, data, tiny_base_models["bert"], tmp_path / "runs", run=ctx)
    base = tf.BertModel.from_pretrained(tiny_base_models["bert"])
    tuned = tf.AutoModelForSequenceClassification.from_pretrained(run.export_dir).bert
    # Two epochs = head, then the top layer: everything below it is bit-identical.
    top = base.config.num_hidden_layers - 1
    for name, param in base.named_parameters():
        after = dict(tuned.named_parameters())[name]
        if name.startswith(f"encoder.layer.{top}.") or name.startswith("pooler."):
            continue
        assert torch.equal(param, after), name
    changed = [
        n
        for n, p in base.named_parameters()
        if n.startswith(f"encoder.layer.{top}.")
        and not torch.equal(p, dict(tuned.named_parameters())[n])
    ]
    assert changed


@pytest.mark.slow
@pytest.mark.integration
def test_finetune_stage_logs_to_mlflow_and_registers_with_lineage(
    ray_session: str,
    mlflow_uri: str,
    tiny_base_models: dict[str, Path],
    shared_data: Path,
    tmp_path: Path,
) -> None:
    from mlflow.tracking import MlflowClient

    from training.tracking.registry import resolve_version

    data = prepared("cola", shared_data, tmp_path / "data")
    tracking = TrackingConfig(tracking_uri=mlflow_uri, experiment="finetune-acceptance")
    lineage = {"base_model_name": "tiny-bert", "base_model_version": "7"}
    ray_cfg = RayConfig(num_workers=2, num_cpus=4)
    ctx = RunContext(tmp_path / "ws", seed=0, ray=ray_cfg, tracking=tracking, name="t")
    summary = finetune_stage(
        finetune_cfg(model_name="cola-tiny"),
        data,
        tiny_base_models["bert"],
        run=ctx,
        lineage=lineage,
    )
    client = MlflowClient(mlflow_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    # The names carry the split: train_loss and val_<metric> per epoch, at the optimizer step
    # it ended on (the MLflow step, not a metric), then test_<metric>.
    metrics = set(run.data.metrics)
    assert {"train_loss", "val_loss", "val_f1_macro", "test_loss", "test_mcc"} <= metrics
    assert not {"loss", "f1_macro", "step", "epoch"} & metrics
    history = (Path(summary["run_dir"]) / "history.jsonl").read_text().splitlines()
    logged = client.get_metric_history(run.info.run_id, "val_f1_macro")
    assert [m.step for m in logged] == [json.loads(row)["step"] for row in history]
    assert run.data.params["finetune.epochs"] == "2"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/report.md", "report/report.html", "report/curves.png"} <= artifacts
    assert "report/confusion_matrix.png" in artifacts
    version = resolve_version(mlflow_uri, "cola-tiny", "newest")
    registered = client.get_model_version("cola-tiny", version.version)
    tags = registered.tags
    assert tags["base_model_name"] == "tiny-bert"
    assert tags["base_model_version"] == "7"
    assert tags["task_type"] == "classification"
    # The registered version's run names what it read, with digests, as MLflow dataset inputs.
    read = client.get_run(registered.run_id).inputs.dataset_inputs
    inputs = {i.dataset.name: i.dataset for i in read}
    assert (
        inputs["downstream"].digest
        == json.loads((data / "manifest.json").read_text())["fingerprint"]
    )
    assert json.loads(inputs["base_model"].source) == {"uri": str(tiny_base_models["bert"])}
    assert inputs["base_model"].digest == model_fingerprint(tiny_base_models["bert"])


def test_an_epochs_mlflow_metrics_carry_their_split_and_no_step() -> None:
    row = {"epoch": 1, "step": 8, "train_loss": 0.5, "loss": 0.7, "accuracy": 0.75}
    assert epoch_metrics(row) == {"train_loss": 0.5, "val_loss": 0.7, "val_accuracy": 0.75}


def test_early_stopping_takes_a_validation_metric_bare_or_by_its_mlflow_name() -> None:
    data = SimpleNamespace(task_type="classification")
    evaluator = Evaluator(data, finetune_cfg(), rank=0, world=1)
    assert evaluator.watched_metric("val_accuracy") == ("accuracy", True)
    assert evaluator.watched_metric("accuracy") == ("accuracy", True)
    assert evaluator.watched_metric("val_loss") == ("loss", False)
    assert evaluator.watched_metric(None) == ("f1_macro", True)  # the primary


def test_features_longer_than_the_models_positions_are_refused_by_key(
    tiny_base_models: dict[str, Path], shared_data: Path, tmp_path: Path
) -> None:
    data = prepared("cola", shared_data, tmp_path / "data")
    job = FinetuneJob(
        finetune=finetune_cfg(features={"max_length": 1024, "stride": 16}),
        seed=0,
        data_dir=data,
        model_dir=tiny_base_models["bert"],
        config_hash="t",
    )
    with pytest.raises(ValueError, match=r"finetune\.features\.max_length=1024 .* 512 positions"):
        run_finetune_worker(job, LocalContext(tmp_path))
