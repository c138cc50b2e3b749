"""How each export layout is logged as an MLflow model that serves (`log_export`).

Every layout (`training.models.export.export_layout`) is logged so that loading the registered
version never gives the model without its adapters, and `mlflow.pyfunc.load_model` answers
requests with the task its family or fine-tuned task implies (`training.models.cards`):
- a plain export: the transformers flavor. A pretrained export whose own class does not suit
  its pipeline (`BertForPreTraining`: a fill-mask pipeline reads `logits`) is logged with the
  pipeline built around its serving class (`BertForMaskedLM`), and the export's own weights in
  place of that class's (`_ServingTransformersFlavor`): MLflow loads the serving class from
  them, a download gives the export back whole.
- a peft adapter export: the transformers flavor of the peft model, with the untouched base
  model (`_PeftTransformersFlavor`).
- lmpipe's bottleneck adapters: a flavor of their own that MLflow's transformers loader
  refuses, verbatim; with a `CodeModel` (the caller's: the loader is fine-tuning's, which this
  layer cannot import) also a models-from-code pyfunc that loads them.
Each has an input example (`input_example`) and an explicit signature (`task_signature`, the
one MLflow would infer from that example): registering runs no prediction, neither to infer a
signature nor to validate the example (`_NO_PREDICTION`); the tests serve every layout instead.

MLflow is imported inside the functions: importing it costs seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard as HubModelCard

from training.models.cards import PIPELINE_TASKS, TASK_PIPELINES, serving_class
from training.models.export import (
    BASE_MODEL_DIR,
    PEFT_CONFIG_FILE,
    export_layout,
    load_export,
    load_peft_export,
    load_serving_model,
)

MODEL_NAME_IN_RUN = "model"  # the LoggedModel's name
# Explicit, because inferring them imports torchvision, which we do not install (docs/stack.md,
# "MLflow's transformers flavor").
_PIP_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
# The MLmodel flavor of a bottleneck-adapter export: not `transformers`, so MLflow's transformers
# loader refuses it rather than load the model without its adapters.
ADAPTERS_FLAVOR = "lmpipe_bottleneck_adapters"
ADAPTERS_ARTIFACT = "export"  # the pyfunc artifact that holds a bottleneck-adapter export
_SENTENCE = "lmpipe serves this sentence."
# MLflow validates an input example by loading the saved model and answering it: seconds of a
# short run, for what the registry tests check on every layout.
_NO_PREDICTION = {"validate_serving_input": False}


@dataclass(frozen=True)
class CodeModel:
    """A models-from-code pyfunc that serves an export MLflow's own flavors cannot load.

    Attributes:
        code: The source of the file MLflow runs to build the model at load time; it ends in
            `mlflow.models.set_model(...)`. Its `load_context` finds the export in
            `context.artifacts["export"]`.
        input_example: A request the model answers.
        signature: Request and answer schema (`mlflow.models.ModelSignature`).
        model_config: Given to the model as `context.model_config`.
        pip_requirements: Packages the model needs beside `pip_requirements()`.
    """

    code: str
    input_example: Any
    signature: Any
    model_config: dict[str, Any] = field(default_factory=dict)
    pip_requirements: tuple[str, ...] = ()


def pip_requirements(with_peft: bool = False) -> list[str]:
    """Pin the packages a logged model needs to the installed versions (no local labels)."""
    names = (*_PIP_PACKAGES, "peft") if with_peft else _PIP_PACKAGES
    return [f"{name}=={version(name).split('+')[0]}" for name in names]


def input_example(task: str, tokenizer: Any) -> Any:
    """A request a `task` pipeline answers: a sentence, a masked one, or a question."""
    if task == "fill-mask":
        return [f"lmpipe serves this {tokenizer.mask_token}."]
    if task == "question-answering":
        return {"question": "What does lmpipe serve?", "context": "lmpipe serves models."}
    if task == "text-generation":
        return ["lmpipe serves"]
    return [_SENTENCE]


def task_signature(task: str, model: Any) -> Any:
    """The request and answer schema of a `task` pipeline around `model`, without running it.

    What MLflow 3.17 infers from `input_example(task, ...)` by running the pipeline (the tests
    compare): a text in, a text out, except text classification (a `label` and a `score`),
    question answering (a `question` and a `context` in) and feature extraction (a float
    vector of the model's width per token).
    """
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, Schema, TensorSpec

    text = Schema([ColSpec("string")])
    inputs, outputs = text, text
    if task == "question-answering":
        inputs = Schema([ColSpec("string", name="question"), ColSpec("string", name="context")])
    elif task == "text-classification":
        outputs = Schema([ColSpec("string", name="label"), ColSpec("double", name="score")])
    elif task == "feature-extraction":
        width = int(model.config.hidden_size)
        outputs = Schema([TensorSpec(np.dtype("float64"), (-1, width))])
    return ModelSignature(inputs=inputs, outputs=outputs)


def set_base_path(adapter_dir: Path, base: str) -> None:
    """Point a peft adapter's `base_model_name_or_path` at `base` (a path, absolute or not)."""
    config_file = adapter_dir / PEFT_CONFIG_FILE
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _transformers_flavor(root: Path) -> dict[str, Any]:
    flavor: dict[str, Any] = yaml.safe_load((root / "MLmodel").read_text())["flavors"]
    return dict(flavor["transformers"])


class _ServingTransformersFlavor:
    """`mlflow.transformers` with the serving class's pipeline and the export's own weights."""

    __name__ = "mlflow.transformers"

    def __init__(self, hf_dir: Path) -> None:
        """Log the weights (and config) of the export `hf_dir`."""
        self.hf_dir = hf_dir

    def save_model(self, path: str, mlflow_model: Any, **kwargs: Any) -> None:
        """Save as `mlflow.transformers.save_model` does, then put the export's weights in place.

        MLflow records the serving class (`pipeline_model_type`) and loads it from whatever
        `model/` holds: the export, whose extra heads that class leaves out.
        """
        import mlflow

        mlflow.transformers.save_model(path=path, mlflow_model=mlflow_model, **kwargs)
        binary = Path(path) / str(_transformers_flavor(Path(path))["model_binary"])
        shutil.rmtree(binary)
        shutil.copytree(self.hf_dir, binary, ignore=shutil.ignore_patterns("README.md"))


class _PeftTransformersFlavor:
    """`mlflow.transformers` for a peft model, with the untouched base model's weights.

    MLflow 3.17 saves a peft model's base with `model.base_model.model.save_pretrained`: with
    LoRA injected, the projections are saved as `...query.base_layer.weight`, which
    `from_pretrained` does not match, so the loaded base would get fresh random projections
    under the adapter. The export's own `base_model/` replaces them. `mlflow.transformers.
    load_model` gives the base to peft itself, so the adapter's relative path is only a hint
    for a reader of the artifact.
    """

    __name__ = "mlflow.transformers"

    def __init__(self, base_dir: Path) -> None:
        """Log the weights of `base_dir` as the peft model's base."""
        self.base_dir = base_dir

    def save_model(self, path: str, mlflow_model: Any, **kwargs: Any) -> None:
        """Save as `mlflow.transformers.save_model` does, then put the clean base in place."""
        import mlflow

        mlflow.transformers.save_model(path=path, mlflow_model=mlflow_model, **kwargs)
        root = Path(path)
        flavor = _transformers_flavor(root)
        binary, adapter = root / str(flavor["model_binary"]), root / str(flavor["peft_adaptor"])
        shutil.rmtree(binary)
        shutil.copytree(self.base_dir, binary)
        set_base_path(adapter, os.path.relpath(binary, adapter))
        (adapter / "README.md").unlink(missing_ok=True)  # peft's template: this machine's paths


class _AdaptersFlavor:
    """A bottleneck-adapter export, verbatim, in a flavor of its own (and a pyfunc if given)."""

    __name__ = ADAPTERS_FLAVOR

    def __init__(self, hf_dir: Path, task_type: str, code_model: CodeModel | None) -> None:
        """Log the export `hf_dir` of a `task_type` model, served by `code_model` if given."""
        self.hf_dir, self.task_type, self.code_model = hf_dir, task_type, code_model

    def save_model(self, path: str, mlflow_model: Any, **kwargs: Any) -> None:
        """Save the export (as the pyfunc's artifact when served), then the MLmodel naming it."""
        binary = "model"
        if self.code_model is None:
            shutil.copytree(self.hf_dir, Path(path) / binary)
        else:
            binary = self._save_pyfunc(path, mlflow_model, self.code_model)
        mlflow_model.add_flavor(
            ADAPTERS_FLAVOR,
            model_binary=binary,
            task_type=self.task_type,
            loader="training.finetune.adapters.load_finetuned (after download_model)",
        )
        mlflow_model.save(str(Path(path) / "MLmodel"))

    def _save_pyfunc(self, path: str, mlflow_model: Any, code_model: CodeModel) -> str:
        """Save the models-from-code pyfunc; return where its copy of the export lies."""
        import mlflow

        with tempfile.TemporaryDirectory(prefix="lmpipe-pyfunc-") as tmp:
            code_file = Path(tmp) / "lmpipe_adapters_model.py"
            code_file.write_text(code_model.code, encoding="utf-8")
            mlflow.pyfunc.save_model(
                path=path,
                python_model=str(code_file),
                artifacts={ADAPTERS_ARTIFACT: str(self.hf_dir)},
                model_config=code_model.model_config,
                input_example=code_model.input_example,
                signature=code_model.signature,
                pip_requirements=[*pip_requirements(), *code_model.pip_requirements],
                mlflow_model=mlflow_model,
            )
        saved = mlflow_model.flavors["python_function"]["artifacts"][ADAPTERS_ARTIFACT]
        return str(saved["path"])


def _card(hf_dir: Path) -> Any:
    return HubModelCard.load(hf_dir / "README.md")


def log_export(
    ids: dict[str, Any],
    hf_dir: Path,
    family: str,
    task_type: str | None = None,
    code_model: CodeModel | None = None,
) -> None:
    """Log `hf_dir` as the MLflow model `ids` names (see the module docstring).

    Args:
        ids: `name`, `model_id` and `run_id` of the LoggedModel to log into.
        hf_dir: A pretrained export, or a fine-tuned export in any layout.
        family: Model family; picks the pipeline task of a pretrained export.
        task_type: A fine-tuned export's downstream task type; None for a pretrained export.
        code_model: The pyfunc that serves a bottleneck-adapter export (ignored for others).

    Raises:
        ValueError: an adapter export without its `task_type`.
    """
    import mlflow

    layout = export_layout(hf_dir)
    if layout != "model" and task_type is None:
        raise ValueError(f"{hf_dir} is an adapter export: register it with its task_type")
    if layout == "adapters" and task_type is not None:
        flavor = _AdaptersFlavor(hf_dir, task_type, code_model)
        mlflow.models.Model.log(None, flavor, **_NO_PREDICTION, **ids)
        return
    task = PIPELINE_TASKS[family] if task_type is None else TASK_PIPELINES[task_type]
    if layout == "model":
        # load_export refuses pickle-only weights: before anything else reads the directory.
        model, tok = load_export(hf_dir, family, task_type)
        saver: Any = mlflow.transformers
        if task_type is None and serving_class(family) != type(model).__name__:
            model, saver = load_serving_model(hf_dir, family), _ServingTransformersFlavor(hf_dir)
        mlflow.models.Model.log(
            None,
            saver,
            transformers_model={"model": model, "tokenizer": tok},
            task=task,
            model_card=_card(hf_dir),
            input_example=input_example(task, tok),
            signature=task_signature(task, model),
            pip_requirements=pip_requirements(),
            **_NO_PREDICTION,
            **ids,
        )
        return
    _log_peft(ids, hf_dir, task, str(task_type))


def _log_peft(ids: dict[str, Any], hf_dir: Path, task: str, task_type: str) -> None:
    import mlflow
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    peft_model = load_peft_export(hf_dir, task_type)
    # peft's save asks the hub whether the base's vocabulary changed unless this names a local
    # directory; the artifact gets a relative path (`_PeftTransformersFlavor`).
    base_dir = (hf_dir / BASE_MODEL_DIR).resolve()
    peft_model.peft_config["default"].base_model_name_or_path = str(base_dir)
    mlflow.models.Model.log(
        None,
        _PeftTransformersFlavor(hf_dir / BASE_MODEL_DIR),
        transformers_model={"model": peft_model, "tokenizer": tok},
        task=task,
        model_card=_card(hf_dir),
        input_example=input_example(task, tok),
        signature=task_signature(task, peft_model),
        pip_requirements=pip_requirements(with_peft=True),
        **_NO_PREDICTION,
        **ids,
    )
