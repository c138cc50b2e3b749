"""bench/time_to_quality.py --family bert|t5: the reference loops and the shared evaluation."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import transformers as tf

BENCH = Path(__file__).resolve().parents[2] / "bench"
BERT = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
}
T5 = {"d_model": 32, "num_heads": 2, "d_ff": 64, "d_kv": 16, "num_layers": 2}


def bench(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def write_config(family: str, overrides: dict[str, Any], vocab: int, path: Path) -> Path:
    """lmpipe's model config for `family` (what the bench's set-up writes), as config.json."""
    from training.models.models import ModelConfig, model_config_for

    specials = {"pad": 0, "eos": 1, "cls": 2, "sep": 3, "mask": 4, "vocab_size": vocab}
    model = ModelConfig.model_validate({"family": family, "dropout": 0.0, "overrides": overrides})
    model_config_for(model, vocab, specials, 32).to_json_file(path)
    return path


@pytest.mark.slow  # builds lmpipe's model and the reference's (imports transformers' models)
@pytest.mark.parametrize(("family", "overrides"), [("bert", BERT), ("t5", T5)])
def test_reference_starts_from_lmpipes_initial_weights(
    family: str, overrides: dict[str, Any], tmp_path: Path
) -> None:
    from training.models.models import ModelConfig, build_model

    config = write_config(family, overrides, 128, tmp_path / "config.json")
    specials = {"pad": 0, "eos": 1, "cls": 2, "sep": 3, "mask": 4, "vocab_size": 128}
    torch.manual_seed(0)  # as training/pretrain/build.py seeds before building
    model_cfg = ModelConfig.model_validate(
        {"family": family, "dropout": 0.0, "overrides": overrides}
    )
    objective = "bert" if family == "bert" else "span_corruption"
    lmpipe = build_model(model_cfg, objective, 128, specials, 32).state_dict()
    cls = tf.BertForPreTraining if family == "bert" else tf.T5ForConditionalGeneration
    ref = bench("plain_reference").build_model({"config": str(config), "seed": 0}, cls).state_dict()
    assert ref.keys() == lmpipe.keys()
    assert all(torch.equal(ref[k], lmpipe[k]) for k in ref)


def test_span_lengths_are_lmpipes() -> None:
    from tasks.examples.objectives.spans import random_spans_helper

    span = bench("span_reference")
    for length, density, mean in [(128, 0.15, 3.0), (512, 0.15, 3.0), (64, 0.2, 2.0), (64, 0.5, 3)]:
        ours = span.compute_input_and_target_lengths(length, density, mean)
        assert ours == random_spans_helper(length, density, mean)


def test_span_corruption_keeps_every_token_and_its_lengths() -> None:
    span = bench("span_reference")
    rng = np.random.default_rng(0)
    chunks = rng.integers(5, 200, size=(6, 141))
    spec = {"recipe": {"noise_density": 0.15, "mean_span": 3.0}, "sentinel_top": 299, "eos": 1}
    batch = span.corrupt(chunks, spec, rng)
    inputs, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    assert inputs.shape == (6, 128)
    assert labels.shape == (6, 29)
    for row, chunk in enumerate(chunks):
        pieces: dict[int, list[int]] = {}
        key = -1
        for token in labels[row, :-1].tolist():  # the targets: sentinel, its span, ...
            if token >= 250:  # a sentinel: ids count down from 299
                key = token
                pieces[key] = []
            else:
                pieces[key].append(token)
        merged = [t for token in inputs[row, :-1].tolist() for t in pieces.get(token, [token])]
        assert merged == chunk.tolist()
        assert sum(len(p) for p in pieces.values()) == 21  # round(141 * 0.15) noise tokens


@pytest.mark.slow  # the session's tiny tokenizers
def test_mlm_reference_reads_pairs_and_masks_batches(
    tiny_base_models: dict[str, Path], tmp_path: Path
) -> None:
    mlm = bench("mlm_reference")
    tokenizer = tf.AutoTokenizer.from_pretrained(tiny_base_models["bert"])
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    ids = np.zeros((8, 16), np.uint16)
    ids[:, :10] = [cls, 20, 21, 22, sep, 30, 31, 32, 33, sep]
    types = np.zeros_like(ids)
    types[:, 5:10] = 1
    table = pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), 16),
            "token_type_ids": pa.FixedSizeListArray.from_arrays(pa.array(types.ravel()), 16),
            "length": pa.array(np.full(8, 10, np.int32)),
            "next_sentence_label": pa.array(np.arange(8) % 2),
        }
    )
    with pa.ipc.new_stream(tmp_path / "train-0.arrow", table.schema) as out:
        out.write_table(table)
    manifest = {"splits": {"train": {"shards": [{"name": "train-0.arrow"}]}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    features = mlm.read_pairs(tmp_path, tokenizer.all_special_ids)
    assert len(features) == 8
    assert features[1]["special_tokens_mask"] == [1, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    recipe = {"batch": 4, "mlm_probability": 0.5, "mask_replace_prob": 0.8}
    spec = {"seed": 0, "recipe": recipe | {"random_replace_prob": 0.1}}
    batch = next(mlm.batches(spec, tokenizer, features))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 10)  # padded to the longest
    chosen = batch["labels"] != -100
    assert chosen.any()
    assert not chosen[:, [0, 4, 9]].any()  # [CLS] and [SEP] are never predicted
    assert set(batch) >= {"attention_mask", "token_type_ids", "next_sentence_label"}


def validation(family: str, rows: int = 6) -> dict[str, np.ndarray]:
    """A fixed validation batch in the shape of the bench's validation.npz."""
    rng = np.random.default_rng(1)
    ids = rng.integers(5, 128, size=(rows, 12))
    if family == "t5":
        labels = rng.integers(5, 128, size=(rows, 5))
        return {
            "input_ids": ids,
            "labels": labels,
            "decoder_input_ids": np.pad(labels, [(0, 0), (1, 0)])[:, :-1],
        }
    labels = np.where(rng.random(ids.shape) < 0.3, ids, -100)
    labels[:, 1] = ids[:, 1]  # at least one masked token a row
    return {
        "input_ids": np.where(labels != -100, 4, ids),
        "token_type_ids": np.zeros_like(ids),
        "labels": labels,
        "next_sentence_label": np.arange(rows) % 2,
    }


@pytest.mark.slow  # a few training steps
@pytest.mark.parametrize(("family", "overrides"), [("bert", BERT), ("t5", T5)])
def test_evaluation_is_the_models_own_loss_and_the_loop_trains(
    family: str, overrides: dict[str, Any], tmp_path: Path
) -> None:
    plain = bench("plain_reference")
    np.savez(tmp_path / "validation.npz", **validation(family))  # type: ignore[arg-type]
    spec = {
        "family": family,
        "seed": 0,
        "config": str(write_config(family, overrides, 128, tmp_path / "config.json")),
        "validation": str(tmp_path / "validation.npz"),
        "eval_every": 2,
        "recipe": {"steps": 4, "warmup": 1, "lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-6}
        | {"weight_decay": 0.01, "grad_clip": 1.0},
    }
    cls = tf.BertForPreTraining if family == "bert" else tf.T5ForConditionalGeneration
    model = plain.build_model(spec, cls).eval()
    val = plain.load_validation(spec["validation"])
    batch = {k: v for k, v in val.items() if k != "decoder_input_ids"}
    with torch.no_grad():
        out = model(**batch)
    own = (
        out.loss
        if family == "t5"
        else torch.nn.functional.cross_entropy(
            out.prediction_logits.flatten(0, 1), val["labels"].flatten()
        )
    )
    assert plain.evaluate(family, model, val)["loss"] == pytest.approx(float(own), rel=1e-5)
    result = plain.train(spec, model, iter([batch] * 4))
    losses = [e["loss"] for e in result["evals"]]
    assert [e["step"] for e in result["evals"]] == [0, 2, 4]
    assert losses[-1] < losses[0]  # four steps on the validation rows themselves


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_recipes_give_the_plain_loop_lmpipes_optimiser_and_schedule(family: str) -> None:
    from pipelines.config import load_config

    ttq = bench("time_to_quality")
    cfg = load_config(ttq.FAMILIES[family].recipe, ["train.max_steps=30"])
    recipe = bench("plain_reference").reference_recipe(cfg)
    assert recipe["steps"] == 30
    assert recipe["warmup"] == 30  # lmpipe's rule: the warm-up never outlasts the run
    assert recipe["batch"] == cfg.train.global_batch_size
    assert (recipe["lr"], recipe["betas"]) == (cfg.train.optim.lr, list(cfg.train.optim.betas))
    assert cfg.train.model.family == family
    assert ttq.FAMILIES[family].steps == load_config(ttq.FAMILIES[family].recipe).train.max_steps
