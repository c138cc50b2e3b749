"""BERT's fast path (training/models/fast/bert.py) against transformers' own BertForPreTraining."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from torch import Tensor

from tasks.common import schema
from tasks.tokenizer.tokenizer import (
    TokenizerConfig,
    to_transformers,
    train_tokenizer,
)
from tests.training.models.fast.fast_parity import (
    assert_same_outputs_and_grads as assert_same_parity,
)
from tests.training.models.fast.fast_parity import stock_forward_calls
from tests.training.pretrain.host_reads import count_host_reads
from training.models.config import ModelConfig
from training.models.fast import as_stock
from training.models.fast.bert import FastBertForPreTraining, FastBertModel, _dropout
from training.models.models import build_model
from training.pretrain.data import MASKED_POSITIONS
from training.pretrain.losses import pretraining_loss
from training.pretrain.losses.common import ATTENTION_MASK

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
B, T = 3, 16
Models = tuple[tf.BertForPreTraining, FastBertForPreTraining]
Call = Callable[[tf.BertModel, dict[str, Tensor]], Any]


def twins(**fields: Any) -> Models:
    """The stock class and the fast one, each built under the same seed, in train mode."""
    config = tf.BertConfig(**(TINY | NO_DROPOUT | fields))
    torch.manual_seed(0)
    stock = tf.BertForPreTraining(copy.deepcopy(config))
    torch.manual_seed(0)
    fast = FastBertForPreTraining(copy.deepcopy(config))
    return stock.train(), fast.train()


def batch(seed: int = 0) -> dict[str, Tensor]:
    """Ids, token types, a padding mask (rows of 16, 11 and 7 tokens), MLM and NSP labels."""
    rng = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, TINY["vocab_size"], (B, T), generator=rng)
    real = torch.arange(T)[None, :] < torch.tensor([T, T - 5, T - 9])[:, None]  # (B, T)
    chosen = (torch.rand(B, T, generator=rng) < 0.25) & real
    chosen[:, 1] = True
    labels = torch.where(chosen, ids, -100)
    return {
        schema.INPUT_IDS: ids.masked_fill(~real, 0).masked_fill(chosen, 4),
        schema.TOKEN_TYPE_IDS: (torch.arange(T)[None, :] >= T // 2).long().expand(B, T),
        ATTENTION_MASK: real.long(),
        schema.LABELS: labels,
        schema.NEXT_SENTENCE_LABEL: torch.tensor([0, 1, 1]),
        MASKED_POSITIONS: labels.flatten().ne(-100).nonzero().squeeze(1),
    }


def four_d(mask: Tensor) -> Tensor:
    return mask.bool()[:, None, None, :]  # (B, 1, 1, T), as losses.encoder._padding_mask


def additive(mask: Tensor) -> Tensor:
    return (1.0 - four_d(mask).float()) * torch.finfo(torch.float32).min


def encode(mask: Callable[[Tensor], Tensor | None], **kwargs: Any) -> Call:
    """A call of the encoder as `pair_loss` makes it, with the mask `mask` makes of the batch's."""

    def call(model: tf.BertModel, b: dict[str, Tensor]) -> Any:
        return model(
            input_ids=b[schema.INPUT_IDS],
            attention_mask=mask(b[ATTENTION_MASK]),
            token_type_ids=b[schema.TOKEN_TYPE_IDS],
            **kwargs,
        )

    return call


def encoder_outputs(call: Call) -> Callable[[Any], list[Tensor]]:
    """The encoder's last hidden state and pooled output under `call` (a dataclass or a tuple)."""

    def outputs(model: Any) -> list[Tensor]:
        out = call(model.bert, batch())
        return [out[0], out[1]]

    return outputs


def assert_same_outputs_and_grads(stock: tf.BertForPreTraining, fast: Any, call: Call) -> None:
    assert_same_parity(stock, fast, encoder_outputs(call))


@pytest.fixture
def stock_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The calls a FastBertModel passes on to the stock forward (its fallback)."""
    return stock_forward_calls(monkeypatch, tf.BertModel, FastBertModel)


def test_fast_bert_starts_from_the_stock_weights_under_the_same_seed() -> None:
    stock, fast = twins()
    assert isinstance(fast.bert, FastBertModel)
    assert fast.config._attn_implementation == "sdpa"
    expected, got = stock.state_dict(), fast.state_dict()
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in stock.named_parameters()]
    assert fast.cls.predictions.decoder.weight is fast.bert.embeddings.word_embeddings.weight
    assert [n for n, _ in fast.named_buffers()] == [n for n, _ in stock.named_buffers()]


@pytest.mark.parametrize(
    "mask",
    [lambda m: None, lambda m: m, four_d, additive],
    ids=["no-mask", "2d-mask", "4d-bool-mask", "4d-additive-mask"],
)
def test_fast_path_gives_the_stock_outputs_and_gradients(
    mask: Callable[[Tensor], Tensor | None], stock_calls: list[str]
) -> None:
    stock, fast = twins()
    assert_same_outputs_and_grads(stock, fast, encode(mask))
    assert stock_calls == []


def test_fast_path_takes_position_ids_and_no_token_types(stock_calls: list[str]) -> None:
    stock, fast = twins()

    def call(model: tf.BertModel, b: dict[str, Tensor]) -> Any:
        positions = torch.arange(T).flip(0)[None, :].expand(B, T)
        return model(input_ids=b[schema.INPUT_IDS], position_ids=positions, return_dict=True)

    assert_same_outputs_and_grads(stock, fast, call)
    assert stock_calls == []


def test_full_forward_gives_the_stock_logits_through_the_fast_encoder(
    stock_calls: list[str],
) -> None:
    stock, fast = twins()
    b = batch()
    args = {k: b[k] for k in (schema.INPUT_IDS, schema.TOKEN_TYPE_IDS, ATTENTION_MASK)}
    with torch.no_grad():
        expected, got = stock.eval()(**args), fast.eval()(**args)
    for key in ("prediction_logits", "seq_relationship_logits"):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-5)
    assert stock_calls == []


def _checkpointing(stock: tf.PreTrainedModel, fast: tf.PreTrainedModel) -> None:
    for model in (stock, fast):
        model.gradient_checkpointing_enable()


def _mark_as_zero3(weight: torch.nn.Parameter) -> None:
    """Mark `weight` as ZeRO-3 marks its parameters (gathered: available)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    weight.ds_id = 0  # type: ignore[attr-defined]
    # Once a ZeRO-3 engine has run in this process, DeepSpeed's linear (which replaces
    # torch's) reads the status of every parameter marked so.
    weight.ds_status = ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]


def _zero3_partitioned(stock: tf.PreTrainedModel, fast: tf.PreTrainedModel) -> None:
    _mark_as_zero3(fast.bert.encoder.layer[0].attention.self.query.weight)


def _embeds(model: tf.BertModel, b: dict[str, Tensor]) -> Any:
    embeds = model.embeddings.word_embeddings(b[schema.INPUT_IDS])
    return model(inputs_embeds=embeds, attention_mask=b[ATTENTION_MASK])


FALLBACKS: dict[str, tuple[dict[str, Any], Callable[..., None] | None, Call]] = {
    "eager-attention": ({"attn_implementation": "eager"}, None, encode(four_d)),
    "decoder": ({"is_decoder": True}, None, encode(lambda m: m, use_cache=False)),
    "chunked-ffn": ({"chunk_size_feed_forward": 4}, None, encode(lambda m: m)),
    "checkpointing": ({}, _checkpointing, encode(four_d)),
    "zero3-weights": ({}, _zero3_partitioned, encode(four_d)),
    "hidden-states": ({}, None, encode(four_d, output_hidden_states=True)),
    "attentions": ({"attn_implementation": "eager"}, None, encode(four_d, output_attentions=True)),
    "tuple-return": ({}, None, encode(four_d, return_dict=False)),
    "unknown-argument": ({}, None, encode(four_d, is_causal=False)),
    "inputs-embeds": ({}, None, _embeds),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_each_fallback_takes_the_stock_forward_with_the_same_results(
    case: str, stock_calls: list[str]
) -> None:
    fields, prepare, call = FALLBACKS[case]
    stock, fast = twins(**fields)
    if prepare is not None:
        prepare(stock, fast)
    assert_same_outputs_and_grads(stock, fast, call)
    assert stock_calls == ["stock"]


def test_dropout_uses_the_configs_probabilities_in_train_mode_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, fast = twins(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.5)
    seen: list[float] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, dropout_p: float = 0.0, **kwargs: Any) -> Tensor:
        seen.append(dropout_p)
        return sdpa(*args, dropout_p=dropout_p, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    call = encode(four_d)
    with torch.no_grad():
        first, second = call(fast.bert, batch())[0], call(fast.bert, batch())[0]
        assert seen == [0.5] * 4
        assert not torch.allclose(first, second)  # the attention dropout is drawn each call
        fast.eval()
        assert torch.equal(call(fast.bert, batch())[0], call(fast.bert, batch())[0])
    assert seen[4:] == [0.0] * 4


def test_hidden_dropout_is_active_in_train_mode() -> None:
    stock, fast = twins(hidden_dropout_prob=0.1)
    call = encode(four_d)
    with torch.no_grad():
        assert not torch.allclose(call(fast.bert, batch())[0], call(fast.bert, batch())[0])
        expected = call(stock.eval().bert, batch())[0]
        torch.testing.assert_close(call(fast.eval().bert, batch())[0], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_drops_a_fraction_p_and_scales_the_rest_as_torch_does(p: float) -> None:
    torch.manual_seed(0)
    ones = torch.ones(200_000, requires_grad=True)
    out = _dropout(ones, p, training=True)
    dropped = (out == 0).float().mean().item()
    assert abs(dropped - p) < 0.005  # about 5 standard errors at 200k draws
    kept = out[out != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))
    out.sum().backward()
    torch.testing.assert_close(ones.grad, out.detach())  # the same mask scales the gradient
    assert _dropout(ones, p, training=False) is ones


def test_a_short_training_run_stays_with_the_stock_class() -> None:
    models = twins()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    for step in range(4):
        losses = []
        for model, opt in zip(models, optimizers, strict=True):
            loss = pretraining_loss(model, "bert", batch(seed=step)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    stock, fast = (m.state_dict() for m in models)
    for name, value in stock.items():
        torch.testing.assert_close(fast[name], value, rtol=0, atol=1e-4, msg=name)


def test_a_fast_training_forward_and_backward_read_nothing_on_the_host(
    stock_calls: list[str],
) -> None:
    _, fast = twins(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    b = batch()  # with masked positions, as the loop's batches carry them
    with count_host_reads() as reads:
        pretraining_loss(fast, "bert", b).loss.backward()
    assert reads == []
    assert stock_calls == []


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    words = [a + b for a in ("ka", "lo", "mi", "ran", "te", "sul") for b in ("vo", "ni", "pe")]
    texts = [" ".join(rng.choices(words, k=rng.randint(4, 10))) + "." for _ in range(200)]
    cfg = TokenizerConfig(family="wordpiece", vocab_size=120, min_frequency=1)
    out = tmp_path_factory.mktemp("tok")
    to_transformers(train_tokenizer(texts, cfg), cfg).save_pretrained(out)
    return out


def test_build_model_trains_the_fast_class_unless_asked_for_transformers() -> None:
    specials = {"pad": 0, "cls": 2, "sep": 3, "mask": 4, "vocab_size": 96}
    fast = build_model(ModelConfig(family="bert"), "bert", 128, specials, 32)
    stock = build_model(
        ModelConfig(family="bert", implementation="transformers"), "bert", 128, specials, 32
    )
    assert type(fast) is FastBertForPreTraining
    assert type(stock) is tf.BertForPreTraining
    assert type(as_stock(fast)) is tf.BertForPreTraining
