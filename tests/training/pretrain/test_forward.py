"""Pretraining forward pass: sparse MLM, document masking, reference losses, metrics, FLOPs."""

import math

import pytest
import torch
import transformers as tf

from tasks.common import schema
from training.models.flops import flops_per_token
from training.models.models import Family, ModelConfig, build_model, model_config_for
from training.models.vocab import mask_padded_vocab, unpad_vocab
from training.pretrain.data import MASKED_POSITIONS
from training.pretrain.losses import eval_metrics, pretraining_loss
from training.pretrain.losses.common import ATTENTION_MASK, POSITION_IDS
from training.pretrain.losses.decoder import causal_logits
from training.pretrain.packing import causal_document_mask, document_ids, document_positions

VOCAB = 512
SPECIALS: dict[str, int | None] = {
    "cls": 2,
    "sep": 3,
    "pad": 0,
    "mask": 4,
    "eos": 3,
    "sentinel_top": VOCAB - 1,
    "vocab_size": VOCAB,
}
B, T = 3, 24


def tiny(family: Family, objective: str, **fields: bool) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    cfg = ModelConfig(family=family, dropout=0.0, **fields)
    return build_model(cfg, objective, VOCAB, SPECIALS, T)


def mlm_batch(objective: str, seed: int = 0) -> dict[str, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (B, T), generator=rng)
    lengths = torch.tensor([T, T - 5, T - 9])
    real = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    ids = ids.masked_fill(~real, 0)
    chosen = (torch.rand(B, T, generator=rng) < 0.2) & real
    chosen[:, 1] = True  # at least one prediction per row
    labels = torch.where(chosen, ids, -100)
    batch = {
        schema.INPUT_IDS: ids.masked_fill(chosen, 4),
        schema.LABELS: labels,
        ATTENTION_MASK: real.long(),
    }
    if objective in ("bert", "sop"):
        batch[schema.TOKEN_TYPE_IDS] = (torch.arange(T)[None, :] >= T // 2).long().expand(B, T)
        key = schema.NEXT_SENTENCE_LABEL if objective == "bert" else schema.SENTENCE_ORDER_LABEL
        batch[key] = torch.tensor([0, 1, 1])
    return batch


def grads(model: tf.PreTrainedModel, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("family", "objective"), [("bert", "bert"), ("bert", "sop"), ("roberta", "roberta")]
)
def test_sparse_mlm_gives_the_dense_loss_and_gradients(family: Family, objective: str) -> None:
    model = tiny(family, objective)
    batch = mlm_batch(objective)
    sparse = pretraining_loss(model, objective, batch)
    sparse_grads = grads(model, sparse.loss)
    dense = pretraining_loss(model, objective, batch, sparse_mlm=False)
    dense_grads = grads(model, dense.loss)

    torch.testing.assert_close(sparse.loss, dense.loss)
    assert sparse_grads.keys() == dense_grads.keys()
    for name, grad in sparse_grads.items():
        torch.testing.assert_close(grad, dense_grads[name], msg=name)
    for key, value in sparse.counts.items():
        torch.testing.assert_close(value, dense.counts[key], msg=key)


@pytest.mark.parametrize(
    ("family", "objective"), [("bert", "bert"), ("bert", "sop"), ("roberta", "roberta")]
)
def test_mlm_loss_equals_the_models_own_loss(family: Family, objective: str) -> None:
    model = tiny(family, objective)
    batch = mlm_batch(objective)
    inputs = {k: batch[k] for k in (schema.INPUT_IDS, ATTENTION_MASK, schema.LABELS)}
    if objective != "roberta":
        inputs[schema.TOKEN_TYPE_IDS] = batch[schema.TOKEN_TYPE_IDS]
        label = schema.NEXT_SENTENCE_LABEL if objective == "bert" else schema.SENTENCE_ORDER_LABEL
        inputs["next_sentence_label"] = batch[label]  # SOP uses the same binary head
    with torch.no_grad():
        reference = model(**inputs).loss
        out = pretraining_loss(model, objective, batch)
    torch.testing.assert_close(out.loss, reference)
    pair = {"bert": "nsp_loss", "sop": "sop_loss"}.get(objective)
    assert set(out.parts) == {"mlm_loss"} | ({pair} if pair else set())
    assert int(out.counts["mlm_total"]) == int((batch[schema.LABELS] != -100).sum())
    assert int(out.counts["input_tokens"]) == int(batch[ATTENTION_MASK].sum())


def test_sparse_mlm_runs_the_head_only_at_masked_positions() -> None:
    model = tiny("bert", "bert")
    batch = mlm_batch("bert")
    rows: list[int] = []
    head = model.get_submodule("cls.predictions")
    hook = head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    pretraining_loss(model, "bert", batch)
    pretraining_loss(model, "bert", batch, sparse_mlm=False)
    hook.remove()
    assert rows == [int((batch[schema.LABELS] != -100).sum()), B]  # (M, D), then (B, T, D)


def test_mlm_batch_without_labels_is_refused() -> None:
    batch = mlm_batch("roberta")
    del batch[schema.LABELS]
    with pytest.raises(KeyError, match="labels"):
        pretraining_loss(tiny("roberta", "roberta"), "roberta", batch)


def test_unknown_objective_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown objective"):
        pretraining_loss(tiny("gpt2", "causal"), "prefix_lm", mlm_batch("roberta"))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_loss_equals_the_models_own_and_skips_padding(family: Family) -> None:
    model = tiny(family, "causal")
    ids = torch.randint(5, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    full = {schema.INPUT_IDS: ids, ATTENTION_MASK: torch.ones(B, T, dtype=torch.long)}
    with torch.no_grad():
        out = pretraining_loss(model, "causal", full)
        torch.testing.assert_close(out.loss, model(input_ids=ids, labels=ids).loss)
        assert int(out.counts["lm_tokens"]) == B * (T - 1)

        padded = full | {ATTENTION_MASK: full[ATTENTION_MASK].clone()}
        padded[ATTENTION_MASK][0, -4:] = 0
        out = pretraining_loss(model, "causal", padded)
    assert int(out.counts["lm_tokens"]) == B * (T - 1) - 4
    assert int(out.counts["input_tokens"]) == B * T - 4


STARTS = [[7, 15], [10]]  # block 0: documents at 0, 7, 15; block 1: at 0, 10


def document_batch(ids: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    documents = torch.from_numpy(document_ids(STARTS, T))
    return {
        schema.INPUT_IDS: ids,
        POSITION_IDS: torch.from_numpy(document_positions(STARTS, T)),
        ATTENTION_MASK: causal_document_mask(documents, dtype),
    }


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_document_masking_hides_the_previous_document(family: Family) -> None:
    model = tiny(family, "causal").eval()
    ids = torch.randint(5, VOCAB, (2, T), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, :7] = (changed[0, :7] + 1) % VOCAB  # rewrite document 1 of block 0
    with torch.no_grad():
        base = causal_logits(model, document_batch(ids, torch.float32))
        after = causal_logits(model, document_batch(changed, torch.float32))
        plain = causal_logits(model, {schema.INPUT_IDS: changed})
        alone = causal_logits(model, {schema.INPUT_IDS: ids[:1, 7:15]})
    assert torch.equal(after[0, 7:], base[0, 7:])  # later documents: bit-identical
    assert not torch.equal(after[0, :7], base[0, :7])
    assert torch.equal(after[1], base[1])
    assert not torch.equal(plain[0, 7:15], base[0, 7:15])  # without the mask it leaks
    torch.testing.assert_close(base[0, 7:15], alone[0], rtol=1e-5, atol=1e-5)


def test_float32_document_mask_drives_a_bfloat16_model() -> None:
    model = tiny("llama", "causal").eval().to(torch.bfloat16)
    ids = torch.randint(5, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = pretraining_loss(model, "causal", document_batch(ids, torch.float32))
    assert torch.isfinite(out.loss)
    assert int(out.counts["input_tokens"]) == 2 * T


def test_span_loss_equals_the_models_own_and_ignores_padded_targets() -> None:
    model = tiny("t5", "span_corruption")
    rng = torch.Generator().manual_seed(4)
    labels = torch.randint(5, VOCAB, (B, 8), generator=rng)
    decoder = torch.cat([torch.zeros(B, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    batch = {
        schema.INPUT_IDS: torch.randint(5, VOCAB, (B, T), generator=rng),
        ATTENTION_MASK: torch.ones(B, T, dtype=torch.long),
        schema.DECODER_INPUT_IDS: decoder,
        schema.LABELS: labels,
    }
    with torch.no_grad():
        out = pretraining_loss(model, "span_corruption", batch)
        reference = model(**{k: v for k, v in batch.items() if k != "decoder_input_ids"}).loss
        torch.testing.assert_close(out.loss, reference)
        assert int(out.counts["span_tokens"]) == B * 8
        batch[schema.LABELS] = labels.clone()
        batch[schema.LABELS][0, -3:] = 0  # pad id
        assert int(pretraining_loss(model, "span_corruption", batch).counts["span_tokens"]) == 21


def test_activation_checkpointing_keeps_loss_and_gradients() -> None:
    batch = {schema.INPUT_IDS: torch.randint(5, VOCAB, (B, T))}
    plain_model = tiny("gpt2", "causal")
    checkpointed = tiny("gpt2", "causal", activation_checkpointing=True)
    plain = pretraining_loss(plain_model, "causal", batch)
    again = pretraining_loss(checkpointed, "causal", batch)
    torch.testing.assert_close(again.loss, plain.loss)
    expected = grads(plain_model, plain.loss)
    for name, grad in grads(checkpointed, again.loss).items():
        torch.testing.assert_close(grad, expected[name], msg=name)


def test_eval_metrics_average_over_tokens_and_pairs() -> None:
    sums = {
        "mlm_nll": 30.0,
        "mlm_correct": 4.0,
        "mlm_total": 10.0,
        "nsp_nll": 2.0,
        "nsp_correct": 3.0,
        "pair_total": 4.0,
        "input_tokens": 100.0,
    }
    metrics = eval_metrics(sums)
    assert metrics == pytest.approx(
        {
            "mlm_loss": 3.0,
            "mlm_accuracy": 0.4,
            "nsp_loss": 0.5,
            "nsp_accuracy": 0.75,
            "perplexity": math.exp(3.0),
            "loss": 3.5,
        }
    )
    assert eval_metrics({"lm_nll": 1e6, "lm_correct": 0.0, "lm_tokens": 1.0})["perplexity"] == (
        math.inf
    )
    assert eval_metrics({}) == {}


def test_eval_metrics_of_summed_batches_weight_by_tokens() -> None:
    model = tiny("t5", "span_corruption")
    rng = torch.Generator().manual_seed(5)
    total: dict[str, float] = {}
    nll, tokens = 0.0, 0
    for width in (4, 9):
        labels = torch.randint(5, VOCAB, (B, width), generator=rng)
        batch = {
            schema.INPUT_IDS: torch.randint(5, VOCAB, (B, T), generator=rng),
            schema.DECODER_INPUT_IDS: torch.cat(
                [torch.zeros(B, 1, dtype=torch.long), labels[:, :-1]], 1
            ),
            schema.LABELS: labels,
        }
        with torch.no_grad():
            out = pretraining_loss(model, "span_corruption", batch)
        for key, value in out.counts.items():
            total[key] = total.get(key, 0.0) + float(value)
        nll += float(out.parts["span_loss"]) * B * width
        tokens += B * width
    metrics = eval_metrics(total)
    assert metrics["span_loss"] == pytest.approx(nll / tokens, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    assert 0.0 <= metrics["span_accuracy"] <= 1.0


def test_flops_per_token_follows_the_palm_formula_on_gpt2_small() -> None:
    config = model_config_for(
        ModelConfig(family="gpt2", size="base"), 50257, {"eos": 50256, "pad": 50256}, 1024
    )
    non_embedding = 124_439_808 - 50257 * 768 - 1024 * 768
    expected = 6 * non_embedding + 12 * 12 * 768 * 1024 + 6 * 768 * 50257
    assert flops_per_token(config, 1024, "causal") == expected


def test_sparse_mlm_counts_the_output_layer_at_masked_positions_only() -> None:
    config = model_config_for(
        ModelConfig(family="bert", size="base"), 30522, {"pad": 0, "vocab_size": 30522}, 512
    )
    sparse = flops_per_token(config, 512, "bert")
    dense = flops_per_token(config, 512, "bert", sparse_mlm=False)
    assert dense - sparse == pytest.approx(0.85 * 6 * 768 * 30522)
    assert 6 * 85e6 < sparse < dense


def test_t5_flops_need_the_target_length() -> None:
    config = model_config_for(ModelConfig(family="t5", size="small"), 32128, SPECIALS, 512)
    with pytest.raises(ValueError, match="target_len"):
        flops_per_token(config, 512, "span_corruption")
    short, long = (flops_per_token(config, 512, "span_corruption", target_len=n) for n in (64, 114))
    assert 0 < short < long


@pytest.mark.parametrize(("family", "objective"), [("bert", "bert"), ("roberta", "roberta")])
def test_masked_positions_from_the_host_give_the_boolean_gathers_loss(
    family: Family, objective: str
) -> None:
    model = tiny(family, objective)
    batch = mlm_batch(objective)
    flat = (batch[schema.LABELS] != -100).flatten().nonzero().squeeze(1)
    gathered = pretraining_loss(model, objective, batch | {MASKED_POSITIONS: flat})
    gathered_grads = grads(model, gathered.loss)
    boolean = pretraining_loss(model, objective, batch)
    torch.testing.assert_close(gathered.loss, boolean.loss)
    for name, grad in grads(model, boolean.loss).items():
        torch.testing.assert_close(grad, gathered_grads[name], msg=name)
    assert model.config._attn_implementation == "sdpa"  # the 4-D padding mask path was taken


def _batch_for(objective: str, vocab: int) -> dict[str, torch.Tensor]:
    """A batch of ids below `vocab` for the MLM, causal or span objective."""
    rng = torch.Generator().manual_seed(7)
    if objective == "bert":
        batch = mlm_batch("bert")
        for key in (schema.INPUT_IDS, schema.LABELS):  # ids of the real vocabulary only
            batch[key] = batch[key].clamp(max=vocab - 1)
        return batch
    ids = torch.randint(5, vocab, (B, T), generator=rng)
    if objective == "causal":
        return {schema.INPUT_IDS: ids}
    labels = torch.randint(5, vocab, (B, 8), generator=rng)
    decoder = torch.cat([torch.zeros(B, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return {
        schema.INPUT_IDS: ids,
        ATTENTION_MASK: torch.ones(B, T, dtype=torch.long),
        schema.DECODER_INPUT_IDS: decoder,
        schema.LABELS: labels,
    }


@pytest.mark.parametrize(
    ("family", "objective"), [("bert", "bert"), ("gpt2", "causal"), ("t5", "span_corruption")]
)
def test_padded_vocabulary_rows_carry_no_probability_and_no_gradient(
    family: Family, objective: str
) -> None:
    real = VOCAB - 12  # padded to VOCAB rows
    torch.manual_seed(0)
    specials = SPECIALS | {"vocab_size": real, "sentinel_top": real - 1}
    model = build_model(ModelConfig(family=family, dropout=0.0), objective, real, specials, T)
    assert model.get_input_embeddings().num_embeddings == VOCAB
    batch = _batch_for(objective, real)
    padded = pretraining_loss(model, objective, batch)
    model.zero_grad()
    padded.loss.backward()  # type: ignore[no-untyped-call]
    embedding_grad = model.get_input_embeddings().weight.grad
    assert embedding_grad is not None
    assert embedding_grad.shape[0] == VOCAB
    assert torch.count_nonzero(embedding_grad[real:]) == 0  # no gradient reaches a padded row

    unpad_vocab(model)  # what the export does: the same model with the tokenizer's rows only
    assert model.get_input_embeddings().num_embeddings == real
    assert not hasattr(model.config, "unpadded_vocab_size")
    unpadded = pretraining_loss(model, objective, batch)
    torch.testing.assert_close(padded.loss, unpadded.loss, rtol=1e-6, atol=1e-6)
    for key, value in unpadded.counts.items():  # argmax hits: no padded id is ever predicted
        torch.testing.assert_close(padded.counts[key], value, rtol=1e-6, atol=1e-6)


def test_padded_logits_get_the_lowest_value_of_their_dtype_in_place() -> None:
    config = model_config_for(ModelConfig(family="gpt2"), 1000, SPECIALS, T)
    assert (config.vocab_size, config.unpadded_vocab_size) == (1024, 1000)
    logits = torch.zeros(2, 3, 1024, dtype=torch.bfloat16)
    assert mask_padded_vocab(logits, config) is logits
    assert bool((logits[..., 1000:] == torch.finfo(torch.bfloat16).min).all())
    assert bool((logits[..., :1000] == 0).all())
    exact = model_config_for(ModelConfig(family="gpt2"), 1024, SPECIALS, T)
    assert exact.vocab_size == 1024
    assert not hasattr(exact, "unpadded_vocab_size")
    unpadded = ModelConfig(family="gpt2", pad_vocab_to_multiple_of=1)
    assert model_config_for(unpadded, 1000, SPECIALS, T).vocab_size == 1000
