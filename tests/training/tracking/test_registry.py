"""The registry on tiny real models and a real MLflow store (SQLite): aliases and serving.

`candidate` moves only to a version no worse than the one holding it, on the same data;
`newest` always moves; the decision is on the version (tags, description). Every export layout
serves through `mlflow.pyfunc` with the task its family or fine-tuned task implies, and
registering it runs no prediction and prints no transformers load report.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

from tasks.tokenizer.tokenizer import (
    TokenizerConfig,
    padded_vocab_size,
    to_transformers,
    train_tokenizer,
)
from training.models.cards import (
    DataRef,
    FinetuneCard,
    ModelCard,
    TokenizerRef,
    render_finetune_card,
)
from training.models.export import BASE_MODEL_DIR, export_layout, export_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SYLLABLES = ["ka", "lo", "mi", "ran", "te", "sul", "vo", "ni", "pe", "dor", "ba", "ish"]
LABELS = ["Oslo", "Lima", "Pune"]
TOKENIZER = TokenizerConfig(family="wordpiece", vocab_size=160, min_frequency=1)
Export = Callable[..., Path]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    words = [a + b for a in SYLLABLES for b in SYLLABLES][:60]
    texts = [" ".join(rng.choices(words, k=rng.randint(4, 10))) + "." for _ in range(400)]
    path = tmp_path_factory.mktemp("tok")
    to_transformers(train_tokenizer(texts, TOKENIZER), TOKENIZER).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert(tok_dir: Path) -> tf.BertForPreTraining:
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    config = tf.BertConfig(
        vocab_size=padded_vocab_size(tok.backend_tokenizer, TOKENIZER),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    return tf.BertForPreTraining(config).eval()


@pytest.fixture(scope="module")
def pretrained(bert: tf.BertForPreTraining, tok_dir: Path, tmp_path_factory: Any) -> Export:
    """Export the tiny BERT with a card of the given held-out loss and examples fingerprint."""
    root = tmp_path_factory.mktemp("exports")

    def export(name: str, eval_loss: float | None = 5.0, data: str = "ex-1") -> Path:
        card = ModelCard(
            family="bert",
            size="tiny",
            parameters=bert.num_parameters(),
            objective="mlm+nsp",
            steps=20,
            tokens_seen=1280,
            data=DataRef(path="examples", fingerprint=data),
            tokenizer=TokenizerRef(fingerprint="tok", family="wordpiece", vocab_size=160),
            metrics={} if eval_loss is None else {"eval_loss": eval_loss},
            git_commit="test",
        )
        return export_model(bert, tok_dir, root / name, card)

    return export


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A SQLite store and an experiment whose artifacts go under tmp: (uri, experiment id)."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    experiment = MlflowClient(uri).create_experiment(
        "registry", artifact_location=(root / "artifacts").as_uri()
    )
    return uri, experiment


def test_candidate_moves_only_to_a_version_no_worse_on_the_same_data(
    pretrained: Export, store: tuple[str, str]
) -> None:
    from mlflow import MlflowClient

    from training.tracking.registry import Registration, register_export, resolve_version

    uri, experiment = store
    client = MlflowClient(uri)
    run_id = client.create_run(experiment).info.run_id
    registration = Registration("gated-bert", "candidate", {"git_commit": "test"})

    def register(export: Path) -> str:
        return register_export(export, "bert", uri, run_id, registration).version

    def aliases() -> dict[str, str]:
        return {a: resolve_version(uri, "gated-bert", a).version for a in ("candidate", "newest")}

    def decision(version: str) -> tuple[str, str, str]:
        mv = client.get_model_version("gated-bert", version)
        return mv.tags["candidate_decision"], mv.tags["candidate_reason"], mv.description

    assert register(pretrained("v1", eval_loss=5.0)) == "1"
    assert aliases() == {"candidate": "1", "newest": "1"}
    assert register(pretrained("v2", eval_loss=6.0)) == "2"  # worse on the same examples
    assert aliases() == {"candidate": "1", "newest": "2"}
    kept, reason, description = decision("2")
    assert kept == "kept"
    assert reason.startswith("eval_loss 6 > 5 of version 1")
    assert description.startswith("A 6,") or description.startswith("A ")
    assert "held-out loss 6.0000" in description.splitlines()[0]
    assert description.splitlines()[-1] == f"@candidate stayed: {reason}."
    assert register(pretrained("v3", eval_loss=4.0)) == "3"  # better: it moves
    assert aliases() == {"candidate": "3", "newest": "3"}
    assert register(pretrained("v4", eval_loss=9.0, data="ex-2")) == "4"  # other examples
    assert aliases() == {"candidate": "4", "newest": "4"}
    moved, reason, _ = decision("4")
    assert moved == "moved"
    assert "not comparable" in reason
    assert "ex-2" in reason
    assert register(pretrained("v5", eval_loss=None)) == "5"  # no metric
    assert aliases() == {"candidate": "5", "newest": "5"}
    assert "no selection metric" in decision("5")[1]
    tags = client.get_model_version("gated-bert", "3").tags
    assert tags["selection_metric"] == "eval_loss"
    assert tags["selection_goal"] == "min"
    assert float(tags["selection_value"]) == 4.0
    assert tags["data_fingerprint"] == "ex-1"
    assert tags["git_commit"] == "test"
    assert "@newest" in client.get_registered_model("gated-bert").description


def finetuned(
    pretrained_dir: Path, tok_dir: Path, strategy: dict[str, Any], out: Path
) -> tuple[Path, torch.Tensor]:
    """A classifier on the tiny BERT, exported as fine-tuning exports (one AdamW step).

    Returns the export and the trained model's logits on `SENTENCE`.
    """
    from training.finetune.strategies import StrategyConfig, apply_strategy, head_prefixes_for

    torch.manual_seed(0)
    model = tf.BertForSequenceClassification.from_pretrained(
        pretrained_dir, num_labels=3, id2label=dict(enumerate(LABELS))
    )
    plan = apply_strategy(model, StrategyConfig.model_validate(strategy), head_prefixes_for(model))
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    batch = dict(tok([SENTENCE, SENTENCE], return_tensors="pt")) | {"labels": torch.tensor([0, 2])}
    optimizer = torch.optim.AdamW(plan.param_groups(1e-2, weight_decay=0.0))
    plan.model(**batch).loss.backward()
    optimizer.step()
    plan.model.eval()
    with torch.no_grad():
        expected = plan.model(**dict(tok(SENTENCE, return_tensors="pt"))).logits
    plan.save_export(out)
    for home in (out, out / BASE_MODEL_DIR) if export_layout(out) != "model" else (out,):
        tok.save_pretrained(home)
    card = FinetuneCard(
        task_type="classification",
        task_name="residence",
        labels=LABELS,
        strategy=strategy["name"],
        base_model=str(pretrained_dir),
        data=DataRef(path="downstream", fingerprint="task-1"),
        best_epoch=1,
        metric="f1_macro",
        higher_is_better=True,
        test={"f1_macro": 0.5},
        git_commit="test",
    )
    (out / "README.md").write_text(render_finetune_card(card))
    return out, expected


SENTENCE = "kalo mi ranvo."


class LoadReports(logging.Handler):
    """Collects transformers' LOAD REPORT records (logged on a `transformers.*` logger)."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        if "LOAD REPORT" in record.getMessage():
            self.events.append(f"load report ({record.name})")


@contextmanager
def watched() -> Iterator[list[str]]:
    """What a block ran of MLflow's predictions at logging time, and which load reports."""
    import mlflow.models.utils as model_utils
    import mlflow.transformers.signature as signature

    events: list[str] = []

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return original(*args, **kwargs)

        return call

    reports = LoadReports(events)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            signature,
            "generate_signature_output",
            counted("signature inference", signature.generate_signature_output),
        )
        patch.setattr(
            model_utils,
            "_validate_serving_input",
            counted("input example validation", model_utils._validate_serving_input),
        )
        logging.getLogger("transformers").addHandler(reports)
        try:
            yield events
        finally:
            logging.getLogger("transformers").removeHandler(reports)


@pytest.mark.parametrize(
    "strategy",
    [None, {"name": "full"}, {"name": "adapters"}, {"name": "lora"}],
    ids=["pretrained", "full", "adapters", "lora"],
)
def test_every_layout_serves_through_pyfunc_with_its_task(
    strategy: dict[str, Any] | None,
    pretrained: Export,
    tok_dir: Path,
    store: tuple[str, str],
    tmp_path: Path,
) -> None:
    import mlflow
    from mlflow import MlflowClient

    from training.finetune.adapters import load_finetuned
    from training.finetune.serving import adapters_code_model
    from training.tracking.registry import (
        Registration,
        _tracking_uri,
        download_model,
        register_export,
    )

    uri, experiment = store
    run_id = MlflowClient(uri).create_run(experiment).info.run_id
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    name = f"serve-{tmp_path.name}"
    base = pretrained(f"base-{tmp_path.name}")
    if strategy is None:
        with watched() as events:
            ref = register_export(base, "bert", uri, run_id, Registration(name, "candidate"))
        assert events == []
        with _tracking_uri(uri):
            answers = mlflow.pyfunc.load_model(ref.model_uri).predict(
                [f"kalo {tok.mask_token} ranvo."]
            )
            served = mlflow.transformers.load_model(ref.model_uri)
        assert len(answers) == 1
        assert answers[0] in tok.get_vocab()  # a token of the vocabulary
        assert served.task == "fill-mask"
        assert type(served.model).__name__ == "BertForMaskedLM"
        local = download_model(uri, ref, tmp_path / "dl")
        assert tf.AutoConfig.from_pretrained(local).architectures == ["BertForPreTraining"]
        return
    export, expected = finetuned(base, tok_dir, strategy, tmp_path / "export")
    code = adapters_code_model(export, "classification") if strategy["name"] == "adapters" else None
    registration = Registration(name, "candidate")
    with watched() as events:
        ref = register_export(export, "bert", uri, run_id, registration, "classification", code)
    assert events == []
    with _tracking_uri(uri):
        model = mlflow.pyfunc.load_model(ref.model_uri)
    assert model.metadata.get_input_schema() is not None
    assert model.metadata.get_output_schema() is not None
    answers = model.predict([SENTENCE])
    assert list(answers["label"]) == [LABELS[int(expected.argmax())]]
    assert float(answers["score"][0]) == pytest.approx(float(expected.softmax(-1).max()), 1e-4)
    if strategy["name"] == "adapters":  # downloads as the export it was
        local = download_model(uri, ref, tmp_path / "dl")
        assert export_layout(local) == "adapters"
        tokens = dict(tok(SENTENCE, return_tensors="pt"))
        with torch.no_grad():
            logits = load_finetuned(local, "classification").eval()(**tokens).logits
        assert torch.allclose(logits, expected, atol=1e-5)
