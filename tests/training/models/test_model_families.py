"""Every family of the model table in-process: forward, backward, export, offline reload, answer.

Tiny real `transformers` models on real tokenizers trained here; no Ray, DeepSpeed or MLflow
(their path is tests/training/pretrain/test_family_pretraining.py, one run per objective group).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
import transformers as tf

from tasks.tokenizer.tokenizer import (
    TokenizerConfig,
    padded_vocab_size,
    to_transformers,
    train_tokenizer,
)
from training.models.cards import PIPELINE_TASKS
from training.models.electra import ElectraPretrainer, corrupt
from training.models.export import (
    DataRef,
    ModelCard,
    TokenizerRef,
    export_model,
    load_export,
    load_serving_model,
)
from training.models.models import FAMILIES, OBJECTIVES, Family
from training.pretrain.config import TrainConfig
from training.pretrain.losses import export_loss, exported_model, pretraining_loss
from training.pretrain.losses.decoder import causal_logits
from training.pretrain.packing import causal_document_mask
from training.pretrain.pretraining_model import build_pretraining_model, zero3_leaf_modules

_TOKENIZER = {
    "wordpiece": {"family": "wordpiece", "vocab_size": 300, "min_frequency": 1},
    "roberta": {"family": "bpe", "bpe_style": "roberta", "vocab_size": 400, "min_frequency": 1},
    "gpt2": {"family": "bpe", "vocab_size": 400, "min_frequency": 1},
    "unigram": {"family": "unigram", "vocab_size": 300, "extra_ids": 8, "min_frequency": 1},
}
_FAMILY_TOKENIZER = {
    "bert": "wordpiece",
    "albert": "wordpiece",
    "distilbert": "wordpiece",
    "electra": "wordpiece",
    "t5": "unigram",
} | {family: "gpt2" for family, spec in FAMILIES.items() if spec.kind == "decoder"}
_WORDS = ["the", "a", "movie", "film", "was", "is", "good", "bad", "great", "plot", "actor"]


def sentences(n: int, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(4, 10, (1,), generator=gen))
        picks = torch.randint(0, len(_WORDS), (k,), generator=gen).tolist()
        out.append(" ".join(_WORDS[i] for i in picks) + ".")
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """Each tokenizer kind trained on the word list, saved; with its padded vocabulary."""
    out = {}
    for name, args in _TOKENIZER.items():
        cfg = TokenizerConfig.model_validate(args)
        backend = train_tokenizer(sentences(400), cfg)
        tok = to_transformers(backend, cfg)
        path = tmp_path_factory.mktemp(f"tok-{name}")
        tok.save_pretrained(path)
        out[name] = (path, padded_vocab_size(backend, cfg))
    return out


def specials(tok: Any) -> dict[str, int | None]:
    ids = {
        "pad": tok.pad_token_id,
        "eos": tok.eos_token_id,
        "cls": tok.cls_token_id,
        "sep": tok.sep_token_id,
        "mask": tok.mask_token_id,
        "vocab_size": len(tok),
    }
    if tok.eos_token_id is None:  # WordPiece: [SEP] ends a sequence
        ids["eos"] = tok.sep_token_id
    return ids


def mlm_labels(ids: torch.Tensor, attention: torch.Tensor, tok: Any) -> tuple[torch.Tensor, ...]:
    """Mask every 4th real non-special token: (masked ids, labels)."""
    special = torch.tensor(
        [[t in tok.all_special_ids for t in row] for row in ids.tolist()], dtype=torch.bool
    )
    chosen = (torch.arange(ids.shape[1]) % 4 == 1) & attention.bool() & ~special
    labels = ids.masked_fill(~chosen, -100)
    return ids.masked_fill(chosen, tok.mask_token_id), labels


def batch_for(objective: str, tok: Any) -> dict[str, torch.Tensor]:
    texts = sentences(4, seed=1)
    if objective in ("bert", "sop"):
        enc = tok(texts[:2], texts[2:], padding=True, return_tensors="pt")
        ids, labels = mlm_labels(enc["input_ids"], enc["attention_mask"], tok)
        pair = "next_sentence_label" if objective == "bert" else "sentence_order_label"
        return {
            "input_ids": ids,
            "attention_mask": enc["attention_mask"],
            "token_type_ids": enc["token_type_ids"],
            "labels": labels,
            pair: torch.tensor([0, 1]),
        }
    if objective == "roberta":
        enc = tok(texts, padding=True, return_tensors="pt")
        ids, labels = mlm_labels(enc["input_ids"], enc["attention_mask"], tok)
        return {"input_ids": ids, "attention_mask": enc["attention_mask"], "labels": labels}
    if objective == "causal":
        ids = tok(" ".join(texts * 3), return_tensors="pt")["input_ids"][:, :32]
        return {"input_ids": ids.reshape(2, 16)}
    source = tok(texts[:2], padding=True, return_tensors="pt")
    target = tok(texts[2:], padding=True, return_tensors="pt")["input_ids"]
    start = tok.eos_token_id if objective == "denoising" else tok.pad_token_id
    decoder = torch.cat([torch.full((2, 1), start), target[:, :-1]], dim=1)
    return {
        "input_ids": source["input_ids"],
        "attention_mask": source["attention_mask"],
        "decoder_input_ids": decoder,
        "labels": target,
    }


def built(family: Family, tokenizers: dict[str, tuple[Path, int]]) -> tuple[Any, ...]:
    tok_dir, rows = tokenizers[_FAMILY_TOKENIZER.get(family, "roberta")]
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    objective = OBJECTIVES[family][0]
    cfg = TrainConfig.model_validate({"model": {"family": family, "size": "tiny"}})
    torch.manual_seed(0)
    model = build_pretraining_model(cfg, objective, rows, specials(tok), 64)
    return model, tok, tok_dir, objective


def card(family: str, model: tf.PreTrainedModel, objective: str) -> ModelCard:
    return ModelCard(
        family=family,  # type: ignore[arg-type]
        size="tiny",
        parameters=model.num_parameters(),
        objective=objective,
        steps=1,
        tokens_seen=64,
        data=DataRef(path="examples/manifest.json", fingerprint="ex"),
        tokenizer=TokenizerRef(fingerprint="tok", family="bpe", vocab_size=400),
        metrics={},
        deepspeed={"zero_stage": 0, "precision": "fp32"},
        git_commit="test",
    )


@pytest.mark.parametrize("family", get_args(Family))
def test_family_trains_exports_reloads_offline_and_answers(
    family: Family, tokenizers: dict[str, tuple[Path, int]], tmp_path: Path
) -> None:
    model, tok, tok_dir, objective = built(family, tokenizers)
    batch = batch_for(objective, tok)
    out = pretraining_loss(model, objective, batch)
    assert math.isfinite(float(out.loss.detach()))
    assert float(out.loss.detach()) > 0
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads) >= 0.8 * len(grads)
    assert all(torch.isfinite(g).all() for g in grads if g is not None)

    exported = exported_model(model).eval()
    model.eval()
    with torch.no_grad():
        expected = float(export_loss(model, objective, batch))
    hf_dir = export_model(exported, tok_dir, tmp_path / "export", card(family, exported, objective))
    reloaded, reloaded_tok = load_export(hf_dir, family)  # offline, safetensors, no key missing
    assert type(reloaded) is FAMILIES[family].model
    reloaded.eval()
    with torch.no_grad():
        assert float(export_loss(reloaded, objective, batch)) == pytest.approx(expected, rel=1e-5)
        answer(family, reloaded, reloaded_tok)
        serves(family, hf_dir, reloaded_tok)


def answer(family: str, model: tf.PreTrainedModel, tok: Any) -> None:
    """The reloaded export answers what its family is for."""
    kind = FAMILIES[family].kind  # type: ignore[index]
    if kind != "encoder":
        prompt = tok("the movie was", return_tensors="pt")
        if kind == "seq2seq":
            generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
        else:
            generated = model.generate(prompt["input_ids"], max_new_tokens=4, do_sample=False)
        assert generated.shape[1] >= 2
        assert int(generated.max()) < model.config.vocab_size
        return
    if family == "electra":  # the discriminator: one replaced-or-original logit per token
        enc = tok("the movie was good.", return_tensors="pt")
        logits = model(**enc).logits
        assert logits.shape == enc["input_ids"].shape
        return
    text = f"the movie {tok.mask_token} good."
    if family in ("bert", "albert"):  # pretraining classes: the MLM logits at the mask
        enc = tok(text, return_tensors="pt")
        logits = model(**enc).prediction_logits
        at = int((enc["input_ids"][0] == tok.mask_token_id).nonzero()[0, 0])
        assert 0 <= int(logits[0, at].argmax()) < model.config.vocab_size
        return
    filled = tf.pipeline("fill-mask", model=model, tokenizer=tok)(text)
    assert len(filled) == 5
    assert all(isinstance(row["token_str"], str) for row in filled)


def serves(family: str, hf_dir: Path, tok: Any) -> None:
    """The export serves the pipeline its family implies, as MLflow builds it: every weight of
    the serving class from the export (a fill-mask pipeline reads `logits`, which BERT's and
    ALBERT's pretraining classes do not give)."""
    task = PIPELINE_TASKS[family]
    if FAMILIES[family].kind != "encoder":  # type: ignore[index]
        assert task == "text-generation"
        return
    model = load_serving_model(hf_dir, family)
    pipe = tf.pipeline(task, model=model, tokenizer=tok)
    if task == "feature-extraction":  # ELECTRA's discriminator: its encoder's hidden states
        features = pipe("the movie was good.")
        assert len(features[0][0]) == model.config.hidden_size
        return
    filled = pipe(f"the movie {tok.mask_token} good.")
    assert len(filled) == 5
    assert all(0 <= row["token"] < model.config.vocab_size for row in filled)
    assert all(isinstance(row["token_str"], str) for row in filled)


def test_electra_discriminator_labels_exactly_the_generators_replacements() -> None:
    ids = torch.tensor([[5, 9, 9, 7, 9, 2], [3, 9, 4, 9, 9, 0]])  # 9 = [MASK]
    original = torch.tensor([[5, 11, 12, 7, 13, 2], [3, 14, 4, 15, 16, 0]])
    labels = torch.where(ids == 9, original, torch.full_like(ids, -100))
    masked = int((labels != -100).sum())
    # A generator certain of the original at the first masked slots, of token 40 elsewhere.
    logits = torch.full((masked, 50), -1e4)
    targets = labels[labels != -100]
    for row in range(masked):
        logits[row, int(targets[row]) if row % 2 == 0 else 40] = 1e4
    sample = corrupt(ids, labels, logits, rng=torch.Generator().manual_seed(0))
    assert torch.equal(sample.original, original)
    unmasked = labels == -100
    assert torch.equal(sample.input_ids[unmasked], original[unmasked])  # nothing else changes
    assert torch.equal(sample.labels.bool(), sample.input_ids != original)
    # Samples equal to the original are labelled original; the others replaced.
    assert int(sample.labels.sum()) == masked // 2
    assert set(sample.input_ids[sample.labels.bool()].tolist()) == {40}


def test_electra_generator_shares_the_discriminators_embeddings(
    tokenizers: dict[str, tuple[Path, int]],
) -> None:
    model, *_ = built("electra", tokenizers)
    assert isinstance(model, ElectraPretrainer)
    disc, gen = model.discriminator.electra, model.generator
    assert gen.electra.embeddings is disc.embeddings
    assert gen.generator_lm_head.weight is disc.embeddings.word_embeddings.weight
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(set(id(p) for p in model.parameters()))  # each tensor once
    assert gen.config.hidden_size <= model.discriminator.config.hidden_size


def test_mixtral_routes_and_adds_its_balance_loss(tokenizers: dict[str, tuple[Path, int]]) -> None:
    model, tok, _, objective = built("mixtral", tokenizers)
    out = pretraining_loss(model, objective, batch_for(objective, tok))
    assert set(out.parts) == {"lm_loss", "aux_loss"}
    assert float(out.parts["aux_loss"]) > 0
    coef = model.config.router_aux_loss_coef
    assert float(out.loss.detach()) == pytest.approx(
        float(out.parts["lm_loss"]) + float(out.parts["aux_loss"]), rel=1e-6
    )
    assert coef > 0


def test_document_masking_keeps_mistrals_sliding_window() -> None:
    torch.manual_seed(0)
    config = tf.MistralConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        sliding_window=4,
    )
    config._attn_implementation = "sdpa"
    model = tf.MistralForCausalLM(config).eval()
    ids = torch.randint(0, 50, (1, 12))
    one_doc = causal_document_mask(torch.zeros(1, 12, dtype=torch.long), torch.float32)
    with torch.no_grad():
        plain = causal_logits(model, {"input_ids": ids})
        masked = causal_logits(
            model,
            {"input_ids": ids, "attention_mask": one_doc, "position_ids": torch.arange(12)[None]},
        )
        # One document: the 4-D mask must give exactly the model's own sliding-window mask.
        torch.testing.assert_close(masked, plain, rtol=1e-5, atol=1e-5)
        # Two documents: the second never sees the first, and still sees only 4 tokens back.
        docs = torch.tensor([[0] * 5 + [1] * 7])
        positions = torch.tensor([list(range(5)) + list(range(7))])
        batch = {"attention_mask": causal_document_mask(docs, torch.float32)}
        changed = ids.clone()
        changed[0, 0] = (ids[0, 0] + 1) % 50  # in document 0
        changed[0, 6] = (ids[0, 6] + 1) % 50  # 5 back from the last token: outside its window
        a = causal_logits(model, {"input_ids": ids, "position_ids": positions, **batch})
        b = causal_logits(model, {"input_ids": changed, "position_ids": positions, **batch})
        torch.testing.assert_close(a[0, -1], b[0, -1])
        assert not torch.allclose(a[0, 6], b[0, 6])


@pytest.mark.parametrize("family", ["longformer", "big_bird"])
def test_long_document_models_train_on_long_inputs_with_sparse_attention(
    family: Family, tokenizers: dict[str, tuple[Path, int]]
) -> None:
    tok_dir, rows = tokenizers["roberta"]
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    cfg = TrainConfig.model_validate({"model": {"family": family, "size": "tiny"}})
    torch.manual_seed(0)
    model = build_pretraining_model(cfg, "roberta", rows, specials(tok), 1024)
    text = " ".join(sentences(200))
    enc = tok(text, return_tensors="pt", truncation=True, max_length=1024)
    assert enc["input_ids"].shape[1] == 1024  # 8x the demo's examples
    ids, labels = mlm_labels(enc["input_ids"], enc["attention_mask"], tok)
    batch = {"input_ids": ids, "attention_mask": enc["attention_mask"], "labels": labels}
    out = pretraining_loss(model, "roberta", batch)
    out.loss.backward()
    assert math.isfinite(float(out.loss.detach()))
    if family == "big_bird":  # long enough to stay block-sparse (short inputs switch to full)
        assert model.config.attention_type == "block_sparse"
    else:  # local windows far shorter than the input
        assert max(model.config.attention_window) < 1024


def test_mixtral_experts_are_zero3_leaf_modules(tokenizers: dict[str, tuple[Path, int]]) -> None:
    model, *_ = built("mixtral", tokenizers)
    leaves = zero3_leaf_modules(model)
    assert leaves == [tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock]
    plain, *_ = built("llama", tokenizers)
    assert zero3_leaf_modules(plain) == []
