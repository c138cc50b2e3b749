"""Export, reload check, DeepSpeed consolidation and MLflow registry on tiny real models (CPU)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from tasks.tokenizer.tokenizer import (
    TokenizerConfig,
    padded_vocab_size,
    to_transformers,
    train_tokenizer,
)
from training.models.config import Family, ModelConfig
from training.models.export import (
    DataRef,
    ExportCheckError,
    ModelCard,
    TokenizerRef,
    UnsafeWeightsError,
    export_model,
    gather_state_dict,
    load_external_weights,
    load_serving_model,
    quiet_load_report,
    read_card,
    reload_check,
)
from training.models.models import OBJECTIVES, build_model, model_class

SYLLABLES = ["ka", "lo", "mi", "ran", "te", "sul", "vo", "ni", "pe", "dor", "ba", "ish"]
TOKENIZERS = {
    "bert": TokenizerConfig(family="wordpiece", vocab_size=160, min_frequency=1),
    "gpt2": TokenizerConfig(family="bpe", vocab_size=320, min_frequency=1),
    "t5": TokenizerConfig(family="unigram", vocab_size=160, extra_ids=8, min_frequency=1),
}
WIDTH = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2}
Exports = dict[str, tuple[tf.PreTrainedModel, Path, ModelCard]]  # family: (model, dir, card)


def sentences(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [a + b for a in SYLLABLES for b in SYLLABLES][:60]
    return [" ".join(rng.choices(words, k=rng.randint(4, 10))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny trained tokenizer per family, saved as `AutoTokenizer` directories."""
    texts = sentences()
    dirs = {}
    for family, cfg in TOKENIZERS.items():
        dirs[family] = tmp_path_factory.mktemp(f"tok-{family}")
        to_transformers(train_tokenizer(texts, cfg), cfg).save_pretrained(dirs[family])
    return dirs


def vocab_rows(tokenizer_dir: Path, family: str) -> int:
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    return padded_vocab_size(tok.backend_tokenizer, TOKENIZERS[family])


def tiny_model(family: str, tokenizer_dir: Path) -> tf.PreTrainedModel:
    """A seeded 2-layer, width-64 model whose embeddings fit the tokenizer."""
    torch.manual_seed(0)
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = vocab_rows(tokenizer_dir, family)
    if family == "bert":
        config = tf.BertConfig(
            vocab_size=rows, intermediate_size=128, max_position_embeddings=64, **WIDTH
        )
        config.pad_token_id = tok.pad_token_id
        return tf.BertForPreTraining(config).eval()
    if family == "gpt2":
        eos = tok.eos_token_id
        gpt2 = {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64}
        config = tf.GPT2Config(vocab_size=rows, bos_token_id=eos, eos_token_id=eos, **gpt2)
        return tf.GPT2LMHeadModel(config).eval()
    pad = tok.pad_token_id
    t5 = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4}
    config = tf.T5Config(vocab_size=rows, pad_token_id=pad, eos_token_id=tok.eos_token_id, **t5)
    config.decoder_start_token_id = pad
    return tf.T5ForConditionalGeneration(config).eval()


def card_for(family: str, model: tf.PreTrainedModel, tokenizer_dir: Path) -> ModelCard:
    return ModelCard(
        family=family,  # type: ignore[arg-type]
        size="tiny",
        parameters=model.num_parameters(),
        objective={"bert": "mlm+nsp", "gpt2": "clm", "t5": "span"}[family],
        steps=20,
        tokens_seen=20 * 8 * 64,
        data=DataRef(path="workspace/examples/manifest.json", fingerprint="ex-1234"),
        tokenizer=TokenizerRef(
            fingerprint="tok-5678",
            family=TOKENIZERS[family].family,
            vocab_size=len(tf.AutoTokenizer.from_pretrained(tokenizer_dir)),
        ),
        metrics={"eval/loss": 5.25, "eval/perplexity": 190.6},
        deepspeed={"zero_stage": 2, "precision": "fp32", "micro_batch": 8},
        git_commit="513984e",
    )


@pytest.fixture(scope="module")
def exports(tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Exports:
    """Each family's tiny model, its export directory and its card."""
    out = {}
    for family, tok_dir in tokenizer_dirs.items():
        model = tiny_model(family, tok_dir)
        card = card_for(family, model, tok_dir)
        hf_dir = export_model(model, tok_dir, tmp_path_factory.mktemp("exp") / family, card)
        out[family] = (model, hf_dir, card)
    return out


def bert_batch(tok_dir: Path) -> dict[str, torch.Tensor]:
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    texts = sentences(4, seed=1)
    batch = dict(tok(texts[:2], texts[2:], padding=True, return_tensors="pt"))
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    batch["next_sentence_label"] = torch.tensor([0, 1])
    return batch


def mlm_loss(model: tf.PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> float:
    return float(model(**batch).loss)


def greedy(model: tf.PreTrainedModel, ids: torch.Tensor, **sampling: float) -> list[int]:
    """Ten new tokens; with `sampling` kwargs, sampled after seeding torch's generator."""
    torch.manual_seed(1234)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=bool(sampling),
        pad_token_id=model.config.eos_token_id,
        **sampling,
    )
    return [int(i) for i in out[0]]


def reload(family: str, hf_dir: Path) -> tf.PreTrainedModel:
    auto = {"bert": tf.AutoModelForPreTraining, "gpt2": tf.AutoModelForCausalLM}
    cls = auto.get(family, tf.AutoModelForSeq2SeqLM)
    return cls.from_pretrained(hf_dir, local_files_only=True).eval()


# --- DeepSpeed consolidation -------------------------------------------------------------


def engine_weights(engine: object, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    module = engine.module  # type: ignore[attr-defined]
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=stage == 3):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_gather_state_dict_equals_engine_weights(
    stage: int, single_process_dist: None, tokenizer_dirs: dict[str, Path], tmp_path: Path
) -> None:
    import deepspeed

    model = tiny_model("bert", tokenizer_dirs["bert"]).train()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    # A torch optimizer object: DeepSpeed's own CPU Adam would JIT-compile C++.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    batch = bert_batch(tokenizer_dirs["bert"])
    for _ in range(2):
        engine.backward(engine(**batch).loss)
        engine.step()
    engine.save_checkpoint(str(tmp_path), tag="ds")

    state = gather_state_dict(tmp_path, "ds")

    expected = engine_weights(engine, stage)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    assert not torch.equal(state["cls.predictions.bias"], initial["cls.predictions.bias"])
    fresh = tf.BertForPreTraining(model.config)
    result = fresh.load_state_dict(state, strict=True)
    assert not result.missing_keys
    assert not result.unexpected_keys


def test_gather_state_dict_names_a_missing_tag(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        gather_state_dict(tmp_path, "nope")


# --- Export round trips ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "gpt2", "t5"])
def test_export_holds_safetensors_tokenizer_and_card(family: str, exports: Exports) -> None:
    _, hf_dir, card = exports[family]
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= names
    assert not {n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))}
    assert ("generation_config.json" in names) == (family != "bert")
    assert [p.name for p in hf_dir.parent.iterdir()] == [family]  # no temp dirs left
    readme = (hf_dir / "README.md").read_text()
    assert readme.startswith("---\nlibrary_name: transformers\npipeline_tag: ")
    for text in ("## Final metrics", "eval/loss", "ex-1234", "tok-5678", "513984e", "zero_stage"):
        assert text in readme
    assert read_card(hf_dir) == card


@pytest.mark.parametrize("family", ["bert", "gpt2", "t5"])
def test_an_export_gives_lmpipes_modules_logits(
    family: Family, tokenizer_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The model lmpipe builds for a family (its preset, e.g. GPT-2's fused tanh GELU) and a
    stock transformers load of its export compute the same logits in fp32, within 1e-5."""
    tok_dir = tokenizer_dirs[family]
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    specials = {"pad": tok.pad_token_id, "cls": tok.cls_token_id, "sep": tok.sep_token_id}
    specials |= {"mask": tok.mask_token_id, "vocab_size": len(tok)}
    specials["eos"] = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    rows = vocab_rows(tok_dir, family)
    torch.manual_seed(0)
    model = build_model(ModelConfig(family=family), OBJECTIVES[family][0], rows, specials, 64)
    hf_dir = export_model(model, tok_dir, tmp_path / family, card_for(family, model, tok_dir))
    ids = torch.randint(5, len(tok), (2, 24))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if family == "t5":
        batch["decoder_input_ids"] = ids[:, :9]
    loaded = reload(family, hf_dir)
    # lmpipe trains its fast subclass where a family has one (training/models/fast/); the
    # export is the stock class all the same.
    stock = model_class(family)
    assert type(loaded) is stock
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == [stock.__name__]
    model.eval()
    with torch.no_grad():
        trained, exported = model(**batch), loaded(**batch)
    key = "prediction_logits" if family == "bert" else "logits"
    assert exported[key].dtype == torch.float32
    torch.testing.assert_close(exported[key], trained[key], rtol=0, atol=1e-5)
    where = {"_name_or_path", "transformers_version"}  # where it was loaded from, and by what
    saved = {k: v for k, v in loaded.config.to_dict().items() if k not in where}
    assert saved == {k: v for k, v in model.config.to_dict().items() if k not in where}


def test_a_bias_free_gpt2_exports_as_stock_gpt2_with_zero_biases(
    tokenizer_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """`model.bias: false` (nanoGPT's bias=False): after training steps the biases are still
    zero, and the stock load of the export computes the trained module's logits within 1e-5."""
    tok_dir = tokenizer_dirs["gpt2"]
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    specials = {"eos": tok.eos_token_id, "pad": tok.pad_token_id, "vocab_size": len(tok)}
    torch.manual_seed(0)
    cfg = ModelConfig(family="gpt2", bias=False)
    model = build_model(cfg, "causal", vocab_rows(tok_dir, "gpt2"), specials, 64).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    ids = torch.randint(5, len(tok), (2, 24))
    for _ in range(3):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert biases
    assert all(not p.requires_grad and not p.any() for p in biases.values())
    hf_dir = export_model(model, tok_dir, tmp_path / "gpt2", card_for("gpt2", model, tok_dir))
    loaded = reload("gpt2", hf_dir)
    assert type(loaded) is tf.GPT2LMHeadModel
    assert not any(p.any() for n, p in loaded.named_parameters() if n.endswith(".bias"))
    assert "lmpipe_zero_biases" not in (hf_dir / "config.json").read_text()
    model.eval()
    with torch.no_grad():
        trained, exported = model(input_ids=ids).logits, loaded(input_ids=ids).logits
    torch.testing.assert_close(exported, trained, rtol=0, atol=1e-5)


def test_model_bias_false_is_for_gpt2_only() -> None:
    with pytest.raises(ValueError, match=r"model\.bias false is for the gpt2 family, not 'bert'"):
        ModelConfig(family="bert", bias=False)


def test_export_sets_tokenizer_max_length_to_the_models(
    exports: Exports,
) -> None:
    lengths = {
        family: tf.AutoTokenizer.from_pretrained(hf_dir).model_max_length
        for family, (_, hf_dir, _) in exports.items()
    }
    assert lengths == {"bert": 64, "gpt2": 64, "t5": TokenizerConfig().model_max_length}
    saved = json.loads((exports["gpt2"][1] / "tokenizer_config.json").read_text())
    assert "local_files_only" not in saved  # how we loaded it is not part of the export


def test_export_replaces_an_earlier_export(
    exports: Exports,
    tokenizer_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    model, _, card = exports["bert"]
    out = tmp_path / "bert"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"old")
    export_model(model, tokenizer_dirs["bert"], out, card)
    assert not (out / "stale.bin").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bert"]


def test_export_refuses_a_card_of_another_family(
    exports: Exports,
    tokenizer_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    model, _, card = exports["bert"]
    with pytest.raises(ValueError, match="gpt2"):
        export_model(
            model,
            tokenizer_dirs["bert"],
            tmp_path / "x",
            card.model_copy(update={"family": "gpt2"}),
        )
    assert not list(tmp_path.iterdir())


def test_bert_export_answers_fill_mask_like_the_trained_model(
    exports: Exports,
) -> None:
    model, hf_dir, _ = exports["bert"]
    fill = tf.pipeline("fill-mask", model=str(hf_dir), tokenizer=str(hf_dir), top_k=5)
    text = f"{sentences(1, seed=2)[0].split()[0]} [MASK] kaka."
    answers = fill(text)
    assert len(answers) == 5
    assert all(a["sequence"] and 0.0 <= a["score"] <= 1.0 for a in answers)
    inputs = fill.tokenizer(text, return_tensors="pt")
    at = int((inputs["input_ids"][0] == fill.tokenizer.mask_token_id).nonzero()[0, 0])
    with torch.no_grad():
        logits = model(**inputs).prediction_logits[0, at]
    assert [a["token"] for a in answers] == logits.topk(5).indices.tolist()


def test_serving_load_of_a_bert_export_prints_no_load_report(exports: Exports) -> None:
    _, hf_dir, _ = exports["bert"]
    reports = logging.getLogger("transformers.modeling_utils")
    level = reports.level
    # A handler on the reporting logger itself sees each record once, whether or not
    # something earlier in the session made transformers' loggers propagate to the root.
    seen: list[logging.LogRecord] = []
    catcher = logging.Handler()
    catcher.emit = seen.append  # type: ignore[method-assign]
    reports.addHandler(catcher)
    try:
        tf.BertForMaskedLM.from_pretrained(hf_dir)  # reports the pooler and sentence-pair head
        plain = [r for r in seen if "LOAD REPORT" in r.getMessage()]
        seen.clear()
        served = load_serving_model(hf_dir, "bert")
        with quiet_load_report():
            tf.BertForMaskedLM.from_pretrained(hf_dir)
        quiet = [r for r in seen if "LOAD REPORT" in r.getMessage()]
    finally:
        reports.removeHandler(catcher)

    assert len(plain) == 1
    assert "cls.seq_relationship.weight" in plain[0].getMessage()
    assert type(served).__name__ == "BertForMaskedLM"
    assert quiet == []
    assert logging.getLogger("transformers.modeling_utils").level == level  # restored


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9}],
    ids=["greedy", "temperature", "top_k", "top_p"],
)
def test_gpt2_export_generates_the_same_tokens(
    sampling: dict[str, float], exports: Exports
) -> None:
    model, hf_dir, _ = exports["gpt2"]
    tok = tf.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ids = tok(sentences(1, seed=3)[0], return_tensors="pt")["input_ids"]
    before = greedy(model, ids, **sampling)
    after = greedy(reload("gpt2", hf_dir), ids, **sampling)
    assert after == before
    assert len(after) == ids.shape[1] + 10


def test_t5_export_maps_text_to_the_same_text(
    exports: Exports,
) -> None:
    model, hf_dir, _ = exports["t5"]
    tok = tf.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ids = tok(sentences(1, seed=4)[0], return_tensors="pt")["input_ids"]
    before, after = greedy(model, ids), greedy(reload("t5", hf_dir), ids)
    assert after == before
    assert isinstance(tok.decode(after, skip_special_tokens=True), str)


# --- Reload check and outside weights ----------------------------------------------------


def test_reload_check_passes_a_faithful_export(
    exports: Exports,
    tokenizer_dirs: dict[str, Path],
) -> None:
    model, hf_dir, _ = exports["bert"]
    batch = bert_batch(tokenizer_dirs["bert"])
    with torch.no_grad():
        expected = mlm_loss(model, batch)
    assert reload_check(hf_dir, "bert", batch, expected, mlm_loss) == pytest.approx(expected)


def test_reload_check_catches_tampered_weights(
    exports: Exports,
    tokenizer_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    model, hf_dir, _ = exports["bert"]
    tampered = shutil.copytree(hf_dir, tmp_path / "tampered")
    weights = load_file(tampered / "model.safetensors")
    weights["bert.embeddings.word_embeddings.weight"] *= 1.5  # tied to the MLM decoder too
    save_file(weights, tampered / "model.safetensors", metadata={"format": "pt"})
    batch = bert_batch(tokenizer_dirs["bert"])
    with torch.no_grad():
        expected = mlm_loss(model, batch)
    with pytest.raises(ExportCheckError, match=f"differs from expected {expected!r}"):
        reload_check(tampered, "bert", batch, expected, mlm_loss)


def test_reload_check_catches_a_vocabulary_larger_than_the_embeddings(
    tokenizer_dirs: dict[str, Path], tmp_path: Path
) -> None:
    config = tf.BertConfig(
        vocab_size=32, intermediate_size=128, max_position_embeddings=64, **WIDTH
    )
    model = tf.BertForPreTraining(config).eval()
    card = card_for("bert", model, tokenizer_dirs["bert"])
    hf_dir = export_model(model, tokenizer_dirs["bert"], tmp_path / "small", card)
    with pytest.raises(ExportCheckError, match="32 embeddings"):
        reload_check(hf_dir, "bert", {}, 0.0, mlm_loss)


def test_load_external_weights_reads_safetensors(
    exports: Exports,
) -> None:
    model, hf_dir, _ = exports["gpt2"]
    state = load_external_weights(hf_dir)
    assert torch.equal(state["transformer.wte.weight"], model.transformer.wte.weight)


def test_load_external_weights_refuses_pickle_only_dirs(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafeWeightsError, match=r"pytorch_model\.bin.*safetensors"):
        load_external_weights(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError):
        load_external_weights(tmp_path)


# --- MLflow registry ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """A SQLite tracking store with an experiment whose artifacts go under tmp: (uri, exp, root)."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    artifacts = (root / "artifacts").as_uri()
    experiment = MlflowClient(uri).create_experiment("export", artifact_location=artifacts)
    return uri, experiment, artifacts


@pytest.fixture
def decoy_default_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A default tracking URI that the registry must neither use nor clear."""
    decoy = tmp_path / "decoy.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{decoy}")
    yield decoy
    assert not decoy.exists()
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{decoy}"


LINEAGE = {
    "corpus_manifest": "c0ffee",
    "tokenizer": "tok-5678",
    "example_config": "ex-1234",
    "deepspeed_config": '{"zero_optimization": {"stage": 2}}',
    "git_commit": "513984e",
}


@pytest.mark.slow
def test_registered_bert_resolves_by_alias_and_reloads_offline(
    exports: Exports,
    mlflow_store: tuple[str, str, str],
    tokenizer_dirs: dict[str, Path],
    decoy_default_store: Path,
    tmp_path: Path,
) -> None:
    from mlflow import MlflowClient

    from training.tracking.registry import (
        Registration,
        download_model,
        register_export,
        resolve_version,
    )

    uri, experiment, artifacts = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(experiment).info.run_id
    model, hf_dir, _ = exports["bert"]

    ref = register_export(
        hf_dir, "bert", uri, run_id, Registration("tiny-bert", "candidate", LINEAGE)
    )

    assert client.get_run(run_id).info.status == "RUNNING"
    found = resolve_version(uri, "tiny-bert", "candidate")
    assert found == ref
    assert resolve_version(uri, "tiny-bert", ref.version).model_uri == ref.model_uri
    version = client.get_model_version("tiny-bert", ref.version)
    assert version.tags == {
        **LINEAGE,
        "family": "bert",
        "selection_metric": "eval_loss",
        "selection_goal": "min",
        "data_fingerprint": "ex-1234",
        "candidate_decision": "moved",
        "candidate_reason": "no version held the alias",
    }  # the card's metrics are named eval/loss: no eval_loss to compare on
    assert "bert model pretrained with lmpipe" in version.description  # the card's summary
    logged = client.get_logged_model(ref.source.removeprefix("models:/"))
    assert logged.artifact_location.startswith(artifacts)  # not ./mlruns of the cwd
    assert "hf_model/README.md" in [f.path for f in client.list_artifacts(run_id, "hf_model")]

    local = download_model(uri, found, tmp_path / "dl")
    reloaded = reload("bert", local)
    tok = tf.AutoTokenizer.from_pretrained(local, local_files_only=True)
    assert tok.model_max_length == 64
    assert read_card(local) == exports["bert"][2]
    batch = bert_batch(tokenizer_dirs["bert"])
    with torch.no_grad():
        want = model(**batch).prediction_logits.argmax(-1)
        got = reloaded(**batch).prediction_logits.argmax(-1)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_registered_gpt2_keeps_a_finished_run_finished_and_moves_the_alias(
    exports: Exports,
    mlflow_store: tuple[str, str, str],
    decoy_default_store: Path,
    tmp_path: Path,
) -> None:
    from mlflow import MlflowClient

    from training.tracking.registry import (
        Registration,
        download_model,
        register_export,
        resolve_version,
    )

    uri, experiment, _ = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(experiment).info.run_id
    client.set_terminated(run_id)
    model, hf_dir, _ = exports["gpt2"]

    registration = Registration("tiny-gpt2", "candidate", LINEAGE)
    first = register_export(hf_dir, "gpt2", uri, run_id, registration)
    second = register_export(hf_dir, "gpt2", uri, run_id, registration)

    assert client.get_run(run_id).info.status == "FINISHED"
    assert (first.version, second.version) == ("1", "2")
    assert resolve_version(uri, "tiny-gpt2", "newest").version == "2"
    local = download_model(uri, resolve_version(uri, "tiny-gpt2", "1"), tmp_path / "dl")
    tok = tf.AutoTokenizer.from_pretrained(local, local_files_only=True)
    ids = tok(sentences(1, seed=5)[0], return_tensors="pt")["input_ids"]
    assert greedy(reload("gpt2", local), ids) == greedy(model, ids)
    assert (local / "generation_config.json").exists()
