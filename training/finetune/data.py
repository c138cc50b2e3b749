"""A prepared downstream task as the fine-tuning loop sees it: tables, features, batches, loss.

`read_prepared` opens a directory written by the downstream stage (`tasks/downstream/stage.py`,
read through `tasks.common.io.read_downstream_dir`), loads the base model's tokenizer and turns
every split into features (`training/finetune/features/features.py`). `TaskData.loss` is the
training loss: the model's own, or class-weighted / focal cross entropy for classification
(`training/finetune/task_losses.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tasks.common import schema
from tasks.common.io import read_downstream_dir
from training.finetune.config import FinetuneConfig
from training.finetune.features.features import Collator, Features, featurize, make_collator
from training.finetune.task_losses import classification_loss, resolve_class_weights
from training.models.task_models import TaskSpec

# Columns a model's forward takes; featurizers may add bookkeeping columns beside them.
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "decoder_input_ids")
TARGETS = ("labels", "start_positions", "end_positions")


@dataclass
class TaskData:
    """One prepared task: its manifest, tokenizer, tables and features per split."""

    manifest: dict[str, Any]
    spec: TaskSpec
    tokenizer: PreTrainedTokenizerBase
    tables: dict[str, pa.Table]
    features: dict[str, Features]
    collator: Collator
    class_weights: torch.Tensor | None = None
    focal_gamma: float | None = None
    source_prefix: str = ""

    @property
    def task_type(self) -> str:
        """One of `tasks.common.schema.DOWNSTREAM_TASK_TYPES`."""
        return str(self.manifest["task_type"])

    @property
    def labels(self) -> list[str]:
        """Label names in index order (classification, token classification)."""
        return [str(x) for x in self.manifest.get("labels") or []]

    @property
    def train(self) -> Features:
        """The training split's features."""
        return self.features["train"]

    def batch(self, split: str, ids: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        """Collate features `ids` of `split` into model inputs and targets on `device`."""
        feats = self.features[split]
        rows = [
            {k: v for k, v in feats[int(i)].items() if k in MODEL_INPUTS + TARGETS} for i in ids
        ]
        return {k: v.to(device) for k, v in self.collator(rows).items()}

    def loss(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of `batch` (weighted or focal for classification when set)."""
        custom = self.task_type == "classification" and (
            self.class_weights is not None or self.focal_gamma is not None
        )
        if not custom:
            return model(**batch).loss  # type: ignore[no-any-return]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits  # (B, C)
        weights = None if self.class_weights is None else self.class_weights.to(logits.device)
        return classification_loss(logits, batch["labels"], weights, self.focal_gamma)


def read_prepared(data_dir: Path, model_dir: Path, cfg: FinetuneConfig) -> TaskData:
    """Open a prepared task and featurize every split with the base model's tokenizer.

    Raises:
        ValueError: the task has no train split, or no validation split to stop early on.
    """
    manifest, tables = read_downstream_dir(data_dir)
    if "train" not in tables:
        raise ValueError(f"{data_dir}: the task has no train split (has {sorted(tables)})")
    if "validation" not in tables:
        raise ValueError(f"{data_dir}: the task has no validation split (has {sorted(tables)})")
    task_type = manifest["task_type"]
    labels = tuple(str(x) for x in manifest.get("labels") or ())
    if task_type not in ("classification", "token_classification"):
        labels = ()
    spec = TaskSpec(task_type=task_type, labels=labels)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    features = {
        split: featurize(table, tokenizer, task_type, cfg.features, labels, cfg.source_prefix)
        for split, table in tables.items()
    }
    data = TaskData(
        manifest,
        spec,
        tokenizer,
        tables,
        features,
        make_collator(task_type, tokenizer),
        source_prefix=cfg.source_prefix,
    )
    if task_type == "classification":
        counts = np.bincount(tables["train"].column(schema.LABEL).to_numpy(), minlength=len(labels))
        data.class_weights = resolve_class_weights(
            cfg.loss.class_weights, counts.tolist(), len(labels)
        )
        data.focal_gamma = cfg.loss.focal_gamma
    return data
