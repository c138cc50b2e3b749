"""What a fine-tuning run leaves: the checked Hugging Face export, predictions and result.json.

The export is written to a temporary directory and renamed into place; it is reloaded (with
its adapters or soft prompt re-attached) and must reproduce the trained model's outputs on a
fixed batch before `result.json`, the run's completion marker, is written last.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.common import schema
from tasks.common.io import write_json_atomic
from training.finetune.data import TaskData
from training.finetune.early_stopping import EarlyStopping
from training.finetune.strategies import StrategyPlan, attach_saved_extras
from training.models.export import TASK_AUTO_CLASSES, ExportCheckError, assert_safetensors_only

RESULT_FILE = "result.json"
EXPORT_DIR = "export"


def run_result(
    data: TaskData,
    history: list[dict[str, Any]],
    stopper: EarlyStopping,
    test: dict[str, float],
    test_predictions: list[Any] | None,
    plan: StrategyPlan,
    train_time_s: float,
    random_init: bool,
) -> dict[str, Any]:
    """The run's summary: curves, best epoch, test metrics, parameters, time."""
    best = stopper.best_epoch if stopper.best_epoch is not None else len(history) - 1
    total = sum(p.numel() for p in plan.model.parameters())
    result: dict[str, Any] = {
        "task_type": data.task_type,
        "labels": data.labels,
        "strategy": plan.cfg.name,
        "random_init": random_init,
        "metric": stopper.metric,
        "best_epoch": best,
        "best_value": stopper.best_value,
        "stopped_epoch": stopper.stopped_epoch,
        "epochs_run": len(history),
        "validation": {k: v for k, v in history[best].items() if k not in ("epoch", "step")},
        "test": test,
        "history": history,
        "trainable_parameters": plan.num_trainable_parameters(),
        "total_parameters": total,
        "train_time_s": train_time_s,
        "windowed_examples": {s: f.num_windowed for s, f in data.features.items()},
        "truncated_examples": {s: f.num_truncated for s, f in data.features.items()},
    }
    if (
        data.task_type == "classification"
        and test_predictions is not None
        and "test" in data.tables
    ):
        gold = data.tables["test"].column(schema.LABEL).to_numpy()[: len(test_predictions)]
        # see training/evaluate/metrics/metrics.py: import cost
        from sklearn.metrics import confusion_matrix

        matrix = confusion_matrix(gold, test_predictions, labels=list(range(len(data.labels))))
        result["confusion_matrix"] = matrix.tolist()
    return result


def _reference_outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.train(False)
    with torch.no_grad():
        out = model(**batch)
    logits = getattr(out, "logits", None)
    return torch.as_tensor(logits if logits is not None else out.start_logits).float().cpu()


def write_outputs(
    run_dir: Path,
    data: TaskData,
    plan: StrategyPlan,
    result: dict[str, Any],
    test_predictions: list[Any] | None,
    card: str,
) -> Path:
    """Export the fine-tuned model, check its reload, write predictions and `result.json`.

    Raises:
        ExportCheckError: the reloaded export's outputs differ from the trained model's.
    """
    split = "validation"
    ids = np.arange(min(4, len(data.features[split])))
    batch = data.batch(split, ids, torch.device("cpu"))
    inputs = {
        k: v for k, v in batch.items() if k not in ("labels", "start_positions", "end_positions")
    }
    if data.task_type in ("seq2seq",):
        inputs["labels"] = batch["labels"]
    expected = _reference_outputs(plan.model, inputs)
    out_dir = run_dir / EXPORT_DIR
    staged = Path(tempfile.mkdtemp(prefix=".export-", dir=run_dir))
    try:
        model = plan.merge_and_export_model()
        model.save_pretrained(staged)
        data.tokenizer.save_pretrained(staged)
        plan.save_extras(staged)
        (staged / "README.md").write_text(card, encoding="utf-8")
        assert_safetensors_only(staged)
        _check_reload(staged, data.task_type, inputs, expected)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staged.rename(out_dir)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if test_predictions is not None:
        with open(run_dir / "predictions_test.jsonl", "w") as handle:
            for i, pred in enumerate(test_predictions):
                handle.write(json.dumps({"index": i, "prediction": pred}) + "\n")
    write_json_atomic(run_dir / RESULT_FILE, result)
    return out_dir


def _check_reload(
    hf_dir: Path, task_type: str, inputs: dict[str, torch.Tensor], expected: torch.Tensor
) -> None:
    model = TASK_AUTO_CLASSES[task_type].from_pretrained(
        hf_dir, local_files_only=True, use_safetensors=True
    )
    wrapped = attach_saved_extras(model, hf_dir)
    got = _reference_outputs(wrapped, inputs)
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        diff = (got - expected).abs().max() if got.shape == expected.shape else "shape"
        raise ExportCheckError(f"{hf_dir}: reloaded outputs differ from the trained model ({diff})")
