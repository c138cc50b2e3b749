"""Task models: a pretrained body from a model directory with a new task head, or a random twin.

Here: `TaskSpec` (task type + label names), the (family, task type) support matrix, and
`load_task_model`, which loads a Hugging Face model directory's safetensors weights into the
`transformers` task class of that task (the pretraining head dropped, the task head newly
initialised) and checks that nothing but the head was missing, or builds the same architecture
from the same config with fresh random weights (the no-pretraining baseline).
Not here: turning tables into inputs (`training/finetune/features/features.py`), strategies, the
training loop. The matrix and the choices behind it are documented in docs/tasks.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import transformers as tf
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)

from tasks.downstream.config import TaskType
from training.models.export import require_safetensors
from training.models.models import FAMILIES, Family

log = logging.getLogger(__name__)

_HEADED: tuple[TaskType, ...] = (
    "classification",
    "regression",
    "token_classification",
    "question_answering",
)

#: What each family can be fine-tuned for. Encoders have no decoder for text generation;
#: decoder-only models phrase seq2seq data as causal_lm (prompt/response); T5 classifies with
#: transformers' T5ForSequenceClassification (zero-shot text-to-text:
#: training/evaluate/prompting.py). A headed task needs the family in transformers' Auto mapping
#: (BART has no token classification model).
_HEADED_MAPPINGS = {
    "classification": MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "regression": MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "token_classification": MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    "question_answering": MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
}
_GENERATION: dict[str, tuple[TaskType, ...]] = {
    "encoder": (),
    "decoder": ("causal_lm",),
    "seq2seq": ("seq2seq",),
}
SUPPORTED_TASKS: dict[str, tuple[TaskType, ...]] = {
    family: (
        *(task for task in _HEADED if family in _HEADED_MAPPINGS[task]),
        *_GENERATION[spec.kind],
    )
    for family, spec in FAMILIES.items()
}
_REFUSAL_HINTS = {
    ("encoder", "seq2seq"): "an encoder has no decoder; use a t5 or bart model for seq2seq",
    ("encoder", "causal_lm"): "an encoder cannot generate; use a gpt2, llama, mistral or mixtral "
    "model",
    ("seq2seq", "causal_lm"): "write the data as seq2seq (text = prompt, target = response)",
    ("decoder", "seq2seq"): "write the data as causal_lm (prompt = source, response = target)",
    ("t5", "causal_lm"): "write the data as seq2seq (text = prompt, target = response)",
}
_KIND: dict[str, str] = {
    family: "t5" if family == "t5" else spec.kind for family, spec in FAMILIES.items()
}

_AUTO_TASK: dict[TaskType, Any] = {
    "classification": tf.AutoModelForSequenceClassification,
    "regression": tf.AutoModelForSequenceClassification,
    "token_classification": tf.AutoModelForTokenClassification,
    "question_answering": tf.AutoModelForQuestionAnswering,
    "seq2seq": tf.AutoModelForSeq2SeqLM,
    "causal_lm": tf.AutoModelForCausalLM,
}
#: Top-level modules of the transformers task classes that are task heads: only their weights
#: may be missing from a model directory (plus a BERT pooler, absent from MLM-only exports).
HEAD_MODULES = frozenset(
    {
        "classifier",
        "pre_classifier",  # DistilBERT
        "pooler",  # DeBERTa's context pooler (a BERT pooler is under the body's prefix)
        "score",
        "qa_outputs",
        "qa_classifier",  # BigBird
        "classification_head",
    }
)


class TaskModelError(ValueError):
    """A model directory cannot serve the task: unsupported pair, or weights that do not fit."""


class TaskSpec(BaseModel):
    """What to fine-tune for: the task type and, for classification tasks, the label names."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    task_type: TaskType = Field(description="One of tasks.common.schema.DOWNSTREAM_TASK_TYPES.")
    labels: tuple[str, ...] = Field(
        (),
        description="Label names in index order (classification: the classes; "
        "token_classification: the BIO tags). Empty for the other task types.",
    )
    family: Family | None = Field(
        None, description="Expected model family; None takes it from the model's config."
    )

    @model_validator(mode="after")
    def _labels_fit_task(self) -> TaskSpec:
        classes = self.task_type in ("classification", "token_classification")
        if classes and len(self.labels) < 2:
            raise ValueError(f"a {self.task_type} task needs at least 2 labels, got {self.labels}")
        if not classes and self.labels:
            raise ValueError(f"a {self.task_type} task takes no labels, got {self.labels}")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"duplicate label names in {self.labels}")
        return self

    @property
    def problem_type(self) -> str | None:
        """The `problem_type` of a sequence-classification head (None for other tasks)."""
        return {"classification": "single_label_classification", "regression": "regression"}.get(
            self.task_type
        )

    @property
    def num_labels(self) -> int:
        """Outputs of the head: classes, 1 for regression, 2 (start, end) for QA, 0 for LMs."""
        if self.labels:
            return len(self.labels)
        return {"regression": 1, "question_answering": 2}.get(self.task_type, 0)


def check_supported(family: str, task_type: str) -> None:
    """Refuse a (family, task type) pair that lmpipe does not fine-tune.

    Raises:
        TaskModelError: naming the pair, what the family supports, and what to do instead.
    """
    if family not in SUPPORTED_TASKS:
        raise TaskModelError(
            f"model type {family!r} is not supported; families: {sorted(SUPPORTED_TASKS)}"
        )
    if task_type in SUPPORTED_TASKS[family]:
        return
    hint = _REFUSAL_HINTS.get((_KIND[family], task_type), "")
    raise TaskModelError(
        f"a {family} model cannot be fine-tuned for {task_type}: {family} supports "
        f"{', '.join(SUPPORTED_TASKS[family])}" + (f"; {hint}" if hint else "")
    )


def _require_safetensors(model_dir: Path) -> None:
    """Refuse a directory without safetensors weights (pickle weights can run code on load)."""
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config)")
    require_safetensors(model_dir)


def task_config(model_dir: Path, spec: TaskSpec) -> tf.PreTrainedConfig:
    """Read the directory's config and set the task fields (labels, problem type, pad id)."""
    config = tf.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    family = str(config.model_type)
    if spec.family is not None and spec.family != family:
        raise TaskModelError(f"{model_dir} holds a {family} model, the task expects {spec.family}")
    check_supported(family, spec.task_type)
    if spec.task_type in _HEADED:
        names = spec.labels or tuple(f"LABEL_{i}" for i in range(spec.num_labels))
        config.num_labels = spec.num_labels
        config.id2label = dict(enumerate(names))
        config.label2id = {name: i for i, name in enumerate(names)}
        config.problem_type = spec.problem_type
    # Decoder classifiers pool the last non-pad token; features pad with eos where there is no
    # pad token (training/finetune/features/features.py: pad_id), so the config must agree.
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = getattr(config, "eos_token_id", None)
    return config  # type: ignore[no-any-return]


def _key_mapping(config: tf.PreTrainedConfig, task_class: Any) -> dict[str, str] | None:
    """Rename checkpoint keys where the task class keeps its body under another name.

    transformers' LlamaForQuestionAnswering keeps the body as `transformer` (for backward
    compatibility) while LlamaForCausalLM saves it as `model`, so from_pretrained would
    otherwise silently re-initialise the whole body.
    """
    saved = config.architectures[0] if config.architectures else None
    source = getattr(tf, saved, None) if saved else None
    src = getattr(source, "base_model_prefix", None)
    dst = task_class.base_model_prefix
    if not src or src == dst:
        return None
    return {rf"^{src}\.": f"{dst}."}


def _check_only_head_missing(model: tf.PreTrainedModel, info: dict[str, Any], where: Path) -> None:
    """Raise unless every missing weight belongs to the new head; log what was new or dropped."""
    pooler = f"{model.base_model_prefix}.pooler."
    body = sorted(
        key
        for key in info["missing_keys"]
        if key.split(".", 1)[0] not in HEAD_MODULES and not key.startswith(pooler)
    )
    if body or info.get("mismatched_keys"):
        raise TaskModelError(
            f"{where} does not fit {type(model).__name__}: missing body weights {body[:8]}"
            f"{' ...' if len(body) > 8 else ''}, mismatched shapes "
            f"{sorted(info.get('mismatched_keys') or [])[:8]}"
        )
    log.info(
        "%s from %s: new head %s; dropped %d pretraining-head tensors",
        type(model).__name__,
        where,
        sorted(info["missing_keys"]),
        len(info["unexpected_keys"]),
    )


def load_task_model(
    model_dir: Path, spec: TaskSpec, random_init: bool = False, seed: int = 0
) -> tf.PreTrainedModel:
    """Load the task model of `spec` from `model_dir` (safetensors only), or its random twin.

    The pretrained variant loads every body weight from the directory, drops the pretraining
    head (MLM/NSP/LM head; a causal or seq2seq LM keeps its LM head) and initialises the new task
    head from `seed`. `random_init=True` builds the same class from the same config with every
    weight freshly initialised from `seed`: the same architecture, no pretraining.
    The global torch RNG is left as it was. The model is returned in eval mode, fp32.

    Raises:
        TaskModelError: unsupported (family, task) pair, family mismatch, or weights that do not
            fit (anything but the head missing, or shapes that differ).
        UnsafeWeightsError: the directory has only pickle weights.
        FileNotFoundError: not a model directory, or no weights.
    """
    model_dir = Path(model_dir)
    _require_safetensors(model_dir)
    config = task_config(model_dir, spec)
    auto = _AUTO_TASK[spec.task_type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if random_init:
            model = auto.from_config(config, dtype=torch.float32)
        else:
            task_class = auto._model_mapping[type(config)]
            model, info = auto.from_pretrained(
                model_dir,
                config=config,
                dtype=torch.float32,
                local_files_only=True,
                use_safetensors=True,
                output_loading_info=True,
                key_mapping=_key_mapping(config, task_class),
            )
            _check_only_head_missing(model, info, model_dir)
    model.train(False)
    return model  # type: ignore[no-any-return]
