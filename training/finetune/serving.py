"""Serve a bottleneck-adapter export through `mlflow.pyfunc`: a models-from-code wrapper.

MLflow's transformers flavor cannot apply lmpipe's bottleneck adapters (peft has no such
method), so a registered version of such an export gets a pyfunc of its own:
`AdaptersPipelineModel` loads the export with `load_finetuned` (adapters applied) and answers
as the task's transformers pipeline does, in the shapes MLflow's transformers flavor gives
(`answer`). `adapters_code_model` is what `training.tracking.registry.register_export` logs it
with: the models-from-code source (never a pickle, which MLflow 3 refuses to load), an input
example, and the signature inferred from the model's own answer to it. Serving it needs lmpipe
importable beside MLflow: the code imports this module. Not here: logging and registering
(`training/tracking/`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import transformers
from mlflow.pyfunc import PythonModel

from training.finetune.adapters import load_finetuned
from training.models.cards import TASK_PIPELINES
from training.tracking.flavors import ADAPTERS_ARTIFACT, CodeModel, input_example

# The file MLflow runs to build the model when it loads the version.
_CODE = '''"""MLflow models-from-code entry of an lmpipe bottleneck-adapter model version."""

import mlflow

from training.finetune.serving import AdaptersPipelineModel

mlflow.models.set_model(AdaptersPipelineModel())
'''


def adapters_pipeline(export_dir: Path, task_type: str) -> Any:
    """The task's transformers pipeline around a bottleneck-adapter export (adapters applied)."""
    model: Any = load_finetuned(export_dir, task_type)  # a transformers model, adapters hooked
    tok = transformers.AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    task = TASK_PIPELINES[task_type]  # a string known at run time, not one of the Literal overloads
    return transformers.pipeline(task, model=model, tokenizer=tok)  # type: ignore[call-overload]


def _texts(model_input: Any) -> list[str]:
    """The request's texts: a string, a list of them, or a table's first column."""
    if isinstance(model_input, pd.DataFrame):
        return [str(x) for x in model_input.iloc[:, 0]]
    if isinstance(model_input, str):
        return [model_input]
    return [str(x) for x in model_input]


def _questions(model_input: Any) -> list[dict[str, str]]:
    rows = model_input.to_dict("records") if isinstance(model_input, pd.DataFrame) else model_input
    rows = [rows] if isinstance(rows, dict) else rows
    return [{"question": str(r["question"]), "context": str(r["context"])} for r in rows]


def answer(pipe: Any, model_input: Any) -> Any:
    """Answer a request with `pipe`, shaped as MLflow's transformers flavor answers it.

    Text classification: a table of `label` and `score`; token classification: each text's
    entity labels joined by commas; question answering: the answers; generation: the texts.
    """
    task = pipe.task
    if task == "question-answering":
        found = [pipe(**row) for row in _questions(model_input)]
        return [str(row["answer"]) for row in found]
    out = pipe(_texts(model_input))
    if task == "text-classification":
        return pd.DataFrame(out)[["label", "score"]]
    if task == "token-classification":
        return [",".join(str(e["entity"]) for e in row) for row in out]
    return [str(row[0]["generated_text"]) for row in out]


class AdaptersPipelineModel(PythonModel):  # type: ignore[misc]
    """A bottleneck-adapter export as an MLflow pyfunc (built by the models-from-code entry)."""

    def load_context(self, context: Any) -> None:
        """Load the version's export (its `export` artifact) with its adapters."""
        export_dir = Path(context.artifacts[ADAPTERS_ARTIFACT])
        self.pipe = adapters_pipeline(export_dir, str(context.model_config["task_type"]))

    def predict(self, context: Any, model_input: pd.DataFrame, params: Any = None) -> Any:
        """Answer a request (see `answer`)."""
        return answer(self.pipe, model_input)


def adapters_code_model(export_dir: Path, task_type: str) -> CodeModel:
    """How `register_export` serves a bottleneck-adapter export: code, example, signature."""
    pipe = adapters_pipeline(export_dir, task_type)
    example = input_example(TASK_PIPELINES[task_type], pipe.tokenizer)
    request = pd.DataFrame([example] if isinstance(example, dict) else {"text": example})
    signature = mlflow.models.infer_signature(example, answer(pipe, request))
    return CodeModel(_CODE, example, signature, model_config={"task_type": task_type})
