"""Model cards: what an export is, how it was made and which pipeline it serves.

Here: the pretrained export's card (`ModelCard`, with `DataRef` and `TokenizerRef`), the
fine-tuned export's (`FinetuneCard`), both rendered as a Hugging Face README through
`huggingface_hub.ModelCard` (the Hub metadata block, then readable sections) and read back
(`read_card`, `read_finetune_card`, `card_summary`); the pipeline task each export serves
(`PIPELINE_TASKS`, `TASK_PIPELINES`, the card's `pipeline_tag`) and the transformers class a
pretrained export's pipeline is built around (`serving_class`). Not here: writing the export
(`training/models/export.py`) and registering it (`training/tracking/registry.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCardData
from huggingface_hub import ModelCard as HubModelCard
from pydantic import BaseModel, ConfigDict, Field

from training.models.models import FAMILIES, Family

ModelFamily = Family

# transformers 5 has no text2text-generation pipeline; T5 and BART serve as text-generation
# (docs/stack.md, "transformers 5 pipelines"). ELECTRA exports its discriminator, which has no
# masked-LM head: it serves feature extraction (`serving_class`).
PIPELINE_TASKS: dict[str, str] = {
    family: "text-generation"
    if spec.kind != "encoder"
    else "feature-extraction"
    if family == "electra"
    else "fill-mask"
    for family, spec in FAMILIES.items()
}
# Fine-tuned exports (keyed by downstream task type, tasks/common/schema.py): the pipeline task
# they serve in MLflow and `pipeline()`.
TASK_PIPELINES: dict[str, str] = {
    "classification": "text-classification",
    "regression": "text-classification",
    "token_classification": "token-classification",
    "question_answering": "question-answering",
    "seq2seq": "text-generation",
    "causal_lm": "text-generation",
}
_TEMPLATE = "---\n{{ card_data }}\n---\n\n{{ body }}\n"
# The metadata keys that hold lmpipe's own record of the card (beside the Hub's keys).
PRETRAINED_KEY = "lmpipe"
FINETUNED_KEY = "lmpipe_finetune"

log = logging.getLogger(__name__)


def serving_class(family: str) -> str:
    """The transformers class a pretrained export of `family` serves its pipeline with.

    A fill-mask pipeline reads the output's `logits`, which `BertForPreTraining` and
    `AlbertForPreTraining` call `prediction_logits`: their masked-LM classes read the same
    masked-LM head from the export and leave the sentence-pair head out. ELECTRA's export is
    the discriminator: its encoder (`ElectraModel`) serves feature extraction.
    """
    name = FAMILIES[family].model_name  # type: ignore[index]
    if PIPELINE_TASKS[family] == "feature-extraction":
        return name.replace("ForPreTraining", "Model")
    if PIPELINE_TASKS[family] == "fill-mask":
        return name.replace("ForPreTraining", "ForMaskedLM")
    return name


class DataRef(BaseModel):
    """The stage output a model was trained on (examples, or a prepared downstream task)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str = Field(description="URI or path of the stage output's manifest.")
    fingerprint: str = Field(description="The stage output's fingerprint.")


class TokenizerRef(BaseModel):
    """The tokenizer a model was trained with."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    fingerprint: str = Field(description="The tokenizer stage's output fingerprint.")
    family: str = Field(description="wordpiece, bpe, unigram or char.")
    vocab_size: int = Field(gt=0, description="Tokens in the vocabulary, specials included.")


class ModelCard(BaseModel):
    """What a pretrained model is and how it was made; rendered as the export's README.md."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    family: ModelFamily = Field(description="Model family (bert, roberta, gpt2, llama, t5).")
    size: str = Field(description="Named size from the model registry, e.g. tiny or base.")
    parameters: int = Field(ge=0, description="Number of parameters (tied weights once).")
    objective: str = Field(description="Pretraining objective, e.g. mlm+nsp, clm, span.")
    steps: int = Field(ge=0, description="Optimizer steps taken.")
    tokens_seen: int = Field(ge=0, description="Training tokens consumed, padding excluded.")
    data: DataRef
    tokenizer: TokenizerRef
    metrics: dict[str, float] = Field(default_factory=dict, description="Final metrics.")
    deepspeed: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="DeepSpeed summary: ZeRO stage, precision, batch."
    )
    git_commit: str = Field(description="Commit of the code that trained the model.")
    created: datetime = Field(default_factory=lambda: datetime.now(UTC), description="UTC.")


class FinetuneCard(BaseModel):
    """What a fine-tuned model is and how well it does; rendered as the export's README.md."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    task_type: str = Field(description="Downstream task type (tasks/common/schema.py).")
    task_name: str = Field(description="The prepared task's name.")
    labels: list[str] = Field(default_factory=list, description="Label names, index order.")
    strategy: str = Field(description="Fine-tuning strategy: full, lora, adapters, ...")
    random_init: bool = Field(False, description="Trained from random weights, not the base.")
    base_model: str = Field(description="The base model's directory or registry reference.")
    data: DataRef
    best_epoch: int = Field(ge=1, description="The epoch whose weights were kept (1-based).")
    metric: str = Field(description="The task's primary metric, e.g. f1_macro.")
    higher_is_better: bool = Field(description="Whether a larger `metric` is better.")
    test: dict[str, float] = Field(default_factory=dict, description="Test-split metrics.")
    git_commit: str = Field(description="Commit of the code that fine-tuned the model.")
    created: datetime = Field(default_factory=lambda: datetime.now(UTC), description="UTC.")


def _table(rows: Mapping[str, object]) -> str:
    lines = ["| field | value |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows.items()]
    return "\n".join(lines)


def _render(data: ModelCardData, sections: list[str]) -> str:
    """The README: the Hub metadata block of `data`, then `sections` (title, summary, ...)."""
    card = HubModelCard.from_template(data, template_str=_TEMPLATE, body="\n\n".join(sections))
    return str(card)


def pretrained_summary(card: ModelCard) -> str:
    """One sentence: what the model is, how long it trained and its final held-out loss."""
    loss = card.metrics.get("eval_loss")
    tail = f"; held-out loss {loss:.4f}" if loss is not None else ""
    return (
        f"A {card.parameters:,}-parameter {card.family} model pretrained with lmpipe "
        f"({card.objective}, {card.steps:,} steps, {card.tokens_seen:,} tokens{tail})."
    )


def render_card(card: ModelCard) -> str:
    """Render a pretrained model's card as a Hugging Face README (Hub metadata block first)."""
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=PIPELINE_TASKS[card.family],
        tags=["lmpipe", card.family, card.objective],
        lmpipe=card.model_dump(mode="json"),  # PRETRAINED_KEY: the card itself, for `read_card`
    )
    d, t = card.data, card.tokenizer
    sections = [
        f"# {card.family}-{card.size}",
        pretrained_summary(card),
        "## Model\n\n"
        + _table({"family": card.family, "size": card.size, "parameters": card.parameters}),
        "## Training\n\n"
        + _table(
            {"objective": card.objective, "steps": card.steps, "tokens seen": card.tokens_seen}
        ),
        "## Data\n\n" + _table({"manifest": d.path, "fingerprint": d.fingerprint}),
        "## Tokenizer\n\n"
        + _table({"family": t.family, "vocab size": t.vocab_size, "fingerprint": t.fingerprint}),
        "## Final metrics\n\n" + (_table(card.metrics) if card.metrics else "None recorded."),
        "## DeepSpeed\n\n" + (_table(card.deepspeed) if card.deepspeed else "Not used."),
        "## Provenance\n\n"
        + _table({"git commit": card.git_commit, "created": card.created.isoformat()}),
    ]
    return _render(data, sections)


def finetuned_summary(card: FinetuneCard) -> str:
    """One sentence: the task, the strategy, the base and the primary test metric."""
    value = card.test.get(card.metric)
    score = f": test {card.metric} {value:.4f}" if value is not None else ""
    init = "random weights" if card.random_init else card.base_model
    return (
        f"A {card.task_type} model for {card.task_name}, fine-tuned with lmpipe "
        f"({card.strategy}) from {init}{score}."
    )


def render_finetune_card(card: FinetuneCard) -> str:
    """Render a fine-tuned model's card as a Hugging Face README (Hub metadata block first).

    The test metrics are the Hub's evaluation results (`model-index`) too.
    """
    task = TASK_PIPELINES[card.task_type]
    results = [
        EvalResult(
            task_type=task,
            dataset_type=card.data.fingerprint,
            dataset_name=card.task_name,
            dataset_split="test",
            metric_type=name,
            metric_value=value,
        )
        for name, value in sorted(card.test.items())
    ]
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=task,
        tags=["lmpipe", card.task_type, card.strategy],
        model_name=f"{card.task_name}-{card.strategy}",
        eval_results=results or None,
        lmpipe_finetune=card.model_dump(mode="json"),  # FINETUNED_KEY
    )
    rows = {
        "base model": card.base_model,
        "initialisation": "random" if card.random_init else "pretrained",
        "task type": card.task_type,
        "strategy": card.strategy,
        "best epoch": card.best_epoch,
        "data fingerprint": card.data.fingerprint,
    }
    test = {f"test {k}": f"{v:.4f}" for k, v in sorted(card.test.items())}
    sections = [
        "# Fine-tuned with lmpipe",
        finetuned_summary(card),
        "## Fine-tuning\n\n" + _table(rows),
        "## Test metrics\n\n" + (_table(test) if test else "None recorded."),
    ]
    return _render(data, sections)


def card_metadata(hf_dir: Path) -> dict[str, Any]:
    """The Hub metadata block of an export's README.md; empty when it has none."""
    readme = hf_dir / "README.md"
    if not readme.is_file():
        return {}
    text = readme.read_text(encoding="utf-8")
    if not text.startswith("---"):  # a card without metadata: the Hub's parser would warn
        return {}
    data = HubModelCard(text, ignore_metadata_errors=True).data
    return dict(data.to_dict())  # type: ignore[no-untyped-call]


def read_card(hf_dir: Path) -> ModelCard:
    """Parse a pretrained export's `ModelCard` back from its README.md metadata block."""
    return ModelCard.model_validate(card_metadata(hf_dir)[PRETRAINED_KEY])


def read_finetune_card(hf_dir: Path) -> FinetuneCard | None:
    """Parse a fine-tuned export's `FinetuneCard` back from its README.md; None without one."""
    found = card_metadata(hf_dir).get(FINETUNED_KEY)
    return None if found is None else FinetuneCard.model_validate(found)


def card_summary(hf_dir: Path) -> str:
    """The card's summary sentence (its first paragraph after the title); empty without one."""
    meta = card_metadata(hf_dir)
    if PRETRAINED_KEY in meta:
        return pretrained_summary(ModelCard.model_validate(meta[PRETRAINED_KEY]))
    if FINETUNED_KEY in meta:
        return finetuned_summary(FinetuneCard.model_validate(meta[FINETUNED_KEY]))
    readme = hf_dir / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    paragraphs = [p.strip() for p in text.split("\n\n")]
    return next((p for p in paragraphs if p and not p.startswith(("#", "|", "---"))), "")
