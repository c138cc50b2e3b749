"""Fine-tuned exports in the formats their libraries load: peft adapters, merged, bottleneck.

Tiny random models (2 layers, width 32), trained 2 steps the way fine-tuning applies each
strategy, exported by `write_outputs` / `StrategyPlan.save_export`, and loaded back offline with
peft's Auto classes (from another working directory, and from a copied workspace), with
`load_finetuned`, and through the MLflow registry (SQLite store): each must give the trained
model's logits. No Ray run.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf
from pydantic import ValidationError
from tokenizers import Tokenizer, models, pre_tokenizers

from training.finetune.adapters import load_finetuned
from training.finetune.outputs import EXPORT_DIR, write_outputs
from training.finetune.strategies import (
    StrategyConfig,
    StrategyPlan,
    apply_strategy,
    head_prefixes_for,
)
from training.models.export import ExportCheckError, load_export

VOCAB = 96
# family: (task type, transformers Auto class, peft Auto class: imported when used, as lmpipe does)
FAMILIES: dict[str, tuple[str, Any, str]] = {
    "bert": (
        "classification",
        tf.AutoModelForSequenceClassification,
        "AutoPeftModelForSequenceClassification",
    ),
    "gpt2": ("causal_lm", tf.AutoModelForCausalLM, "AutoPeftModelForCausalLM"),
    "t5": ("seq2seq", tf.AutoModelForSeq2SeqLM, "AutoPeftModelForSeq2SeqLM"),
}
STRATEGIES = {
    "lora": {"name": "lora", "lora": {"dropout": 0.0}},  # a peft adapter by default
    "prompt_tuning": {"name": "prompt_tuning", "prompt": {"num_virtual_tokens": 3}},
}

# Tiny matmuls gain nothing from a second thread and crawl when cores are shared.
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(family: str) -> tf.PreTrainedModel:
    fields: dict[str, Any] = {"vocab_size": VOCAB, "pad_token_id": 0, "num_labels": 3}
    if family == "bert":
        config: Any = tf.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, **fields,
        )  # fmt: skip
    elif family == "gpt2":
        config = tf.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=2, eos_token_id=2,
            **fields,
        )  # fmt: skip
    else:
        config = tf.T5Config(
            d_model=32, num_layers=2, num_heads=2, d_ff=64, d_kv=16, eos_token_id=2,
            decoder_start_token_id=0, **fields,
        )  # fmt: skip
    torch.manual_seed(0)
    return FAMILIES[family][1].from_config(config)  # type: ignore[no-any-return]


def tiny_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A word-level tokenizer of exactly VOCAB tokens (peft resizes a model to a larger one)."""
    words = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(words, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="w0", unk_token="w1", eos_token="w2"
    )


def batch_for(family: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (4, 10), generator=gen)
    ids[:, -1] = 2  # eos
    labels = torch.randint(0, 3, (4,), generator=gen) if family == "bert" else ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def trained_plan(family: str, strategy: dict[str, Any]) -> StrategyPlan:
    """Apply the strategy as fine-tuning does and take two AdamW steps."""
    model = tiny_model(family)
    plan = apply_strategy(model, StrategyConfig.model_validate(strategy), head_prefixes_for(model))
    optimizer = torch.optim.AdamW(plan.param_groups(1e-2, weight_decay=0.0))
    batch = batch_for(family)
    for _ in range(2):
        plan.model.train()
        plan.model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return plan


def logits(model: torch.nn.Module, family: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(**batch_for(family)).logits
    return out


@dataclass
class TinyTaskData:
    """What `write_outputs` reads of a `TaskData`: task type, tokenizer, validation batches."""

    task_type: str
    tokenizer: Any
    family: str

    @property
    def features(self) -> dict[str, range]:
        return {"validation": range(4)}

    def batch(self, split: str, ids: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        return {k: v[torch.as_tensor(ids)] for k, v in batch_for(self.family).items()}


def export_run(family: str, strategy: dict[str, Any], run_dir: Path) -> tuple[Path, torch.Tensor]:
    """Train, then export as a fine-tuning run does; (export dir, the trained logits)."""
    plan = trained_plan(family, strategy)
    expected = logits(plan.model, family)
    data = TinyTaskData(FAMILIES[family][0], tiny_tokenizer(), family)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_outputs(run_dir, data, plan, {}, None, "# tiny\n")  # type: ignore[arg-type]
    return run_dir / EXPORT_DIR, expected


def auto_peft(family: str) -> Any:
    import peft

    return getattr(peft, FAMILIES[family][2])


def adapter_config(export: Path) -> Any:
    return json.loads((export / "adapter_config.json").read_text())


def base_path(export: Path) -> Any:
    return adapter_config(export)["base_model_name_or_path"]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_adapter_export_loads_with_auto_peft_to_the_trained_logits(
    strategy: str, family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task_type, auto, _ = FAMILIES[family]
    plan = trained_plan(family, STRATEGIES[strategy])
    expected = logits(plan.model, family)
    export = tmp_path / "export"

    files = {p.relative_to(export).as_posix() for p in plan.save_export(export)}

    assert {"adapter_config.json", "adapter_model.safetensors", "config.json"} <= files
    assert {"base_model/config.json", "base_model/model.safetensors"} <= files
    assert "model.safetensors" not in files  # nothing at the top a plain load could take
    assert base_path(export) == str(export / "base_model")  # absolute: loads from anywhere
    modules = adapter_config(export)["modules_to_save"] or []
    assert len(modules) == len(set(modules))
    monkeypatch.chdir(tmp_path)
    loaded = auto_peft(family).from_pretrained(str(export), local_files_only=True)
    assert torch.equal(logits(loaded, family), expected)
    assert torch.equal(logits(load_finetuned(export, task_type), family), expected)
    with pytest.raises(OSError, match=r"no file named model\.safetensors"):
        auto.from_pretrained(export, local_files_only=True)


def test_the_export_setting_defaults_to_an_adapter_where_the_strategy_trains_one() -> None:
    formats = {n: StrategyConfig(name=n).export_format() for n in ("full", "lora")}
    formats |= {n: StrategyConfig(name=n).export_format() for n in ("prompt_tuning", "adapters")}
    assert formats == {
        "full": "merged",
        "lora": "adapter",
        "prompt_tuning": "adapter",
        "adapters": "adapter",
    }
    assert StrategyConfig(name="lora", export="merged").export_format() == "merged"
    cfg = StrategyConfig(name="prompt_tuning", export="adapter")
    assert StrategyConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    with pytest.raises(ValidationError, match="prompt_tuning cannot be merged"):
        StrategyConfig(name="prompt_tuning", export="merged")
    with pytest.raises(ValidationError, match="adapters cannot be merged"):
        StrategyConfig(name="adapters", export="merged")
    with pytest.raises(ValidationError, match="full trains no adapter"):
        StrategyConfig(name="full", export="adapter")


def test_a_merged_lora_export_loads_with_plain_from_pretrained(tmp_path: Path) -> None:
    export, expected = export_run("bert", {"name": "lora", "export": "merged"}, tmp_path / "run")

    reloaded = tf.AutoModelForSequenceClassification.from_pretrained(export)

    assert not (export / "adapter_config.json").exists()
    assert torch.allclose(logits(reloaded, "bert"), expected, atol=1e-5)


def test_bottleneck_export_refuses_a_plain_from_pretrained(tmp_path: Path) -> None:
    export, expected = export_run("bert", {"name": "adapters"}, tmp_path / "run")

    for plain in (tf.AutoModelForSequenceClassification, tf.BertForSequenceClassification):
        with pytest.raises(OSError, match=r"no file named model\.safetensors"):
            plain.from_pretrained(export, local_files_only=True)
    with pytest.raises(ExportCheckError, match="load_finetuned"):
        load_export(export, "bert", "classification")
    assert "load_finetuned" in (export / "README.md").read_text()
    assert torch.equal(logits(load_finetuned(export, "classification"), "bert"), expected)


def test_a_lora_export_in_a_copied_workspace_loads_with_auto_peft_from_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.common.workspace import open_workspace
    from training.runtime.driver import RunIdentity

    original, copy, elsewhere = tmp_path / "ws", tmp_path / "copy", tmp_path / "elsewhere"
    open_workspace(original)
    identity = RunIdentity("finetune", {"data": "d"}, {"strategy": "lora"}, 0, {})
    run = identity.place(original / "finetune", original)
    _, expected = export_run("bert", STRATEGIES["lora"], run.path)  # the default: an adapter
    run.commit({"export_dir": str(run.export_dir)})
    shutil.copytree(original, copy)
    shutil.rmtree(original)  # nothing may be read from where it was

    open_workspace(copy)  # what every lmpipe command does first
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    export = copy / "finetune" / run.key / "export"
    assert base_path(export) == str(export / "base_model")
    loaded = auto_peft("bert").from_pretrained(str(export), local_files_only=True)
    assert torch.equal(logits(loaded, "bert"), expected)
    assert identity.place(copy / "finetune", copy).reuse() is not None  # still a finished run


# --- MLflow registry ----------------------------------------------------------------------


@pytest.fixture
def mlflow_run(mlflow_uri: str, tmp_path: Path) -> tuple[str, str]:
    """A run in the session's SQLite store, its artifacts under tmp: (uri, run id)."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_uri)
    artifacts = (tmp_path / "artifacts").as_uri()
    experiment = client.create_experiment(f"peft-{tmp_path.name}", artifact_location=artifacts)
    return mlflow_uri, client.create_run(experiment).info.run_id


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "family"), [("lora", "bert"), ("prompt_tuning", "gpt2")], ids=["lora", "prompt"]
)
def test_registered_adapter_export_loads_the_adapted_model_from_anywhere(
    strategy: str,
    family: str,
    mlflow_run: tuple[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlflow
    import peft

    from training.tracking.registry import (
        Registration,
        _tracking_uri,
        download_model,
        register_export,
    )

    task_type = FAMILIES[family][0]
    uri, run_id = mlflow_run
    export, expected = export_run(family, STRATEGIES[strategy], tmp_path / "run")
    name = f"peft-{tmp_path.name}"
    ref = register_export(export, family, uri, run_id, Registration(name, "candidate"), task_type)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    with _tracking_uri(uri):  # MLflow's own loader, as a user calls it
        components = mlflow.transformers.load_model(ref.model_uri, return_type="components")
    assert isinstance(components["model"], peft.PeftModel)
    assert torch.equal(logits(components["model"], family), expected)

    local = download_model(uri, ref, tmp_path / "dl")
    assert base_path(local) == str((tmp_path / "dl" / "base_model").resolve())  # absolute
    modules = adapter_config(local)["modules_to_save"] or []
    assert len(modules) == len(set(modules))  # peft's load appended the head again: deduplicated
    loaded = auto_peft(family).from_pretrained(str(local), local_files_only=True)
    assert torch.equal(logits(loaded, family), expected)
    moved = Path(shutil.move(local, tmp_path / "moved"))  # the base path is stale now
    assert torch.equal(logits(load_finetuned(moved, task_type), family), expected)


@pytest.mark.slow
def test_registered_bottleneck_export_is_refused_by_mlflow_loaders_and_loads_with_lmpipe(
    mlflow_run: tuple[str, str], tmp_path: Path
) -> None:
    import mlflow
    from mlflow.exceptions import MlflowException

    from training.tracking.registry import (
        Registration,
        _tracking_uri,
        download_model,
        register_export,
    )

    uri, run_id = mlflow_run
    export, expected = export_run("bert", {"name": "adapters"}, tmp_path / "run")
    name = f"peft-{tmp_path.name}"
    ref = register_export(
        export, "bert", uri, run_id, Registration(name, "candidate"), "classification"
    )

    with _tracking_uri(uri), pytest.raises(MlflowException, match="transformers"):
        mlflow.transformers.load_model(ref.model_uri)
    local = download_model(uri, ref, tmp_path / "dl")
    assert torch.equal(logits(load_finetuned(local, "classification"), "bert"), expected)
