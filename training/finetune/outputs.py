"""What a fine-tuning run leaves: the checked Hugging Face export, predictions and result.json.

The export (merged, or the base model plus its adapter: `StrategyPlan.save_export`) is written to
a temporary directory and renamed into place; it is reloaded (`load_finetuned`, adapters applied)
and must reproduce the trained model's outputs on a fixed batch before `result.json`, the run's
completion marker, is written last.
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
from training.finetune.adapters import load_finetuned
from training.finetune.data import TaskData
from training.finetune.early_stopping import EarlyStopping
from training.finetune.strategies import StrategyPlan
from training.models.export import (
    BASE_MODEL_DIR,
    ExportCheckError,
    assert_safetensors_only,
    export_layout,
)
from training.runtime.driver import EXPORT_DIR

RESULT_FILE = "result.json"
# Appended to the card of an adapter export: how to load it (docs/strategies.md, "Exports").
_LOADING = {
    "peft": "\n## Loading\n\nA peft adapter (`adapter_config.json`, `adapter_model.safetensors`) "
    "with its frozen base model in `base_model/`, which `base_model_name_or_path` names by its "
    "absolute path (rewritten when lmpipe opens a moved or copied workspace): "
    '`AutoPeftModelFor<Task>.from_pretrained("<dir>")` from any working directory, or '
    "`training.finetune.adapters.load_finetuned(<dir>, task_type)`. "
    "`from_pretrained` of this directory alone fails: it holds no model weights.\n",
    "adapters": "\n## Loading\n\nlmpipe bottleneck adapters (`adapters.json`, "
    "`adapters.safetensors`; peft has no such method) beside the model without them in "
    "`base_model/`. Load with `training.finetune.adapters.load_finetuned(<dir>, task_type)`. "
    "`from_pretrained` of this directory alone fails: it holds no model weights.\n",
}


def run_result(
    data: TaskData,
    history: list[dict[str, Any]],
    stopper: EarlyStopping,
    test: dict[str, float],
    plan: StrategyPlan,
    train_time_s: float,
    random_init: bool,
) -> dict[str, Any]:
    """The run's summary: curves, best epoch, test metrics, parameters, time.

    A classification run's confusion matrix is apart: `confusion_entry`.
    """
    best = stopper.best_epoch if stopper.best_epoch is not None else len(history) - 1
    total = sum(p.numel() for p in plan.model.parameters())
    return {
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


def confusion_entry(data: TaskData, test_predictions: list[Any] | None) -> dict[str, Any]:
    """`{"confusion_matrix": rows}` of a classification run's test predictions; else empty.

    Rows are gold labels and columns predicted ones, both in `data.labels` order.
    """
    if data.task_type != "classification" or test_predictions is None or "test" not in data.tables:
        return {}
    gold = data.tables["test"].column(schema.LABEL).to_numpy()[: len(test_predictions)]
    # see training/scoring/metrics/metrics.py: import cost
    from sklearn.metrics import confusion_matrix

    matrix = confusion_matrix(gold, test_predictions, labels=list(range(len(data.labels))))
    return {"confusion_matrix": matrix.tolist()}


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
        plan.save_export(staged, home=out_dir)  # a peft adapter names its base in `out_dir`
        layout = export_layout(staged)
        # The base model of an adapter export is a complete Hugging Face directory too.
        for home in [staged, staged / BASE_MODEL_DIR] if layout != "model" else [staged]:
            data.tokenizer.save_pretrained(home)
            assert_safetensors_only(home)
        (staged / "README.md").write_text(card + _LOADING.get(layout, ""), encoding="utf-8")
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
    got = _reference_outputs(load_finetuned(hf_dir, task_type), inputs)
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        diff = (got - expected).abs().max() if got.shape == expected.shape else "shape"
        raise ExportCheckError(f"{hf_dir}: reloaded outputs differ from the trained model ({diff})")
