"""GPT-2's fast path (training/models/fast/gpt2.py) against transformers' own GPT2LMHeadModel."""

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
from training.models.attention import DOCUMENT_FLEX, register_document_flex
from training.models.bias import drop_biases, has_zero_biases
from training.models.config import ModelConfig
from training.models.fast import as_stock
from training.models.fast.gpt2 import FastGPT2LMHeadModel, packed_sequence_mask
from training.models.models import build_model
from training.pretrain.data import DOCUMENT_IDS
from training.pretrain.losses.common import POSITION_IDS
from training.pretrain.losses.decoder import causal_loss
from training.pretrain.packing import causal_document_mask, document_block_mask

TINY = {
    "vocab_size": 96,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 32,
    "activation_function": "gelu_pytorch_tanh",  # lmpipe's GPT-2 preset
    "bos_token_id": 1,
    "eos_token_id": 1,
}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
B, T = 3, 16
STARTS = [[0], [0, 5], [0, 4, 11]]  # documents of each row: one, two and three
Models = tuple[tf.GPT2LMHeadModel, FastGPT2LMHeadModel]
Call = Callable[[tf.GPT2LMHeadModel, dict[str, Tensor]], Any]


def twins(attn: str = "sdpa", **fields: Any) -> Models:
    """The stock class and the fast one, each built under the same seed, in train mode."""
    config = tf.GPT2Config(**(TINY | NO_DROPOUT | fields))
    config._attn_implementation = attn
    torch.manual_seed(0)
    stock = tf.GPT2LMHeadModel(copy.deepcopy(config))
    torch.manual_seed(0)
    fast = FastGPT2LMHeadModel(copy.deepcopy(config))
    return stock.train(), fast.train()


def batch(seed: int = 0) -> dict[str, Tensor]:
    """Ids, and the document ids and positions of a packed block (rows of 1, 2, 3 documents)."""
    rng = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, TINY["vocab_size"], (B, T), generator=rng)
    starts = torch.zeros(B, T, dtype=torch.long)
    for row, row_starts in enumerate(STARTS):
        starts[row, row_starts] = 1
    documents = starts.cumsum(1) - 1  # (B, T)
    first = torch.cummax(torch.where(starts.bool(), torch.arange(T), 0), dim=1).values
    positions = torch.arange(T) - first  # (B, T): restarting at each document
    return {schema.INPUT_IDS: ids, DOCUMENT_IDS: documents, POSITION_IDS: positions}


def lm_call(mask: str = "none", positions: str = "none", **kwargs: Any) -> Call:
    """A forward as `causal_logits` makes it: ids, a mask and positions of the given kinds."""

    def call(model: tf.GPT2LMHeadModel, b: dict[str, Tensor]) -> Any:
        masks: dict[str, Any] = {
            "none": None,
            "4d-additive": causal_document_mask(b[DOCUMENT_IDS], torch.float32),
            "4d-bool": causal_document_mask(b[DOCUMENT_IDS], torch.float32) == 0,
            "2d-padding": (torch.arange(T)[None, :] < torch.tensor([[T], [T - 3], [T - 6]])),
        }
        position_ids = {
            "none": None,
            "documents": b[POSITION_IDS],
            "arange": torch.arange(T)[None, :],  # (1, T): broadcast over the batch
        }[positions]
        return model(
            input_ids=b[schema.INPUT_IDS],
            attention_mask=masks[mask],
            position_ids=position_ids,
            **({"use_cache": False} | kwargs),
        )

    return call


def logits_of(call: Call) -> Callable[[Any], list[Tensor]]:
    """The logits under `call` (a dataclass or a tuple: the logits first)."""
    return lambda model: [call(model, batch())[0]]


def assert_same_outputs_and_grads(stock: tf.GPT2LMHeadModel, fast: Any, call: Call) -> None:
    assert_same_parity(stock, fast, logits_of(call))


@pytest.fixture
def stock_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The calls a FastGPT2LMHeadModel passes on to the stock forward (its fallback)."""
    return stock_forward_calls(monkeypatch, tf.GPT2LMHeadModel, FastGPT2LMHeadModel)


def test_fast_gpt2_starts_from_the_stock_weights_under_the_same_seed() -> None:
    stock, fast = twins()
    expected, got = stock.state_dict(), fast.state_dict()
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in stock.named_parameters()]
    assert [n for n, _ in fast.named_buffers()] == [n for n, _ in stock.named_buffers()]
    assert fast.lm_head.weight is fast.transformer.wte.weight  # tied, as the stock class


@pytest.mark.parametrize(
    ("mask", "positions"),
    [
        ("none", "none"),
        ("none", "arange"),
        ("none", "documents"),  # restarting positions: transformers' packed-sequence mask
        ("4d-additive", "documents"),  # what the causal loss passes for packed documents
        ("4d-additive", "none"),
        ("4d-bool", "documents"),
    ],
)
def test_fast_path_gives_the_stock_logits_and_gradients(
    mask: str, positions: str, stock_calls: list[str]
) -> None:
    stock, fast = twins()
    assert_same_outputs_and_grads(stock, fast, lm_call(mask, positions))
    assert stock_calls == []


@pytest.mark.parametrize(("mask", "positions"), [("none", "none"), ("4d-additive", "documents")])
def test_bias_free_fast_path_gives_the_stock_logits_and_gradients(
    mask: str, positions: str, stock_calls: list[str]
) -> None:
    """`model.bias: false`: the fast path leaves the zero, frozen biases out of its ops; the
    stock forward adds them. Same logits, same gradients, and no bias gets one."""
    stock, fast = twins()
    for model in (stock, fast):
        drop_biases(model)
    assert has_zero_biases(fast)
    assert_same_outputs_and_grads(stock, fast, lm_call(mask, positions))
    assert all(p.grad is None for n, p in fast.named_parameters() if n.endswith(".bias"))
    assert stock_calls == []


@pytest.mark.parametrize("activation", ["gelu_new", "relu", "silu"])
def test_fast_path_applies_the_configs_activation(activation: str, stock_calls: list[str]) -> None:
    stock, fast = twins(activation_function=activation, scale_attn_by_inverse_layer_idx=True)
    assert_same_outputs_and_grads(stock, fast, lm_call("4d-additive", "documents"))
    assert stock_calls == []


def test_fast_path_computes_the_stock_loss_from_labels(stock_calls: list[str]) -> None:
    stock, fast = twins()
    ids = batch()[schema.INPUT_IDS]
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.2, -100)
    expected = stock(input_ids=ids, labels=labels, use_cache=False)
    got = fast(input_ids=ids, labels=labels, use_cache=False)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=1e-6)
    assert type(got) is type(expected)
    assert stock_calls == []


def test_document_flex_without_a_block_mask_takes_the_fast_path(stock_calls: list[str]) -> None:
    register_document_flex()
    stock, fast = twins(attn=DOCUMENT_FLEX)
    assert_same_outputs_and_grads(stock, fast, lm_call("4d-additive", "documents"))
    assert stock_calls == []


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_block_mask_takes_the_stock_forward(stock_calls: list[str]) -> None:
    register_document_flex()
    stock, fast = twins(attn=DOCUMENT_FLEX)
    b = batch()
    block_mask = document_block_mask(b[DOCUMENT_IDS])
    args = {"input_ids": b[schema.INPUT_IDS], "position_ids": b[POSITION_IDS], "use_cache": False}
    with torch.no_grad():  # FlexAttention has no backward on a CPU
        expected = stock(attention_mask=block_mask, **args).logits
        got = fast(attention_mask=block_mask, **args).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert stock_calls == ["stock"]


@pytest.mark.parametrize("documents", [False, True], ids=["plain-causal", "documents"])
def test_the_loss_takes_the_logits_without_the_module_call_and_gets_the_same(
    documents: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, fast = twins()
    b = batch() if documents else {schema.INPUT_IDS: batch()[schema.INPUT_IDS]}
    calls: list[str] = []
    fast.register_forward_pre_hook(lambda module, args: calls.append("call"))
    hooked = causal_loss(fast, b).loss  # a hook of its own: the module is called
    assert calls == ["call"]
    fast._forward_pre_hooks.clear()
    direct = causal_loss(fast, b).loss  # none: the fast class's logits, no call
    assert calls == ["call"]
    assert torch.equal(direct, hooked)
    monkeypatch.setattr(FastGPT2LMHeadModel, "pretraining_logits", lambda *a: None)
    assert torch.equal(causal_loss(fast, b).loss, direct)  # what the call gives


def test_packed_sequence_mask_follows_restarting_positions() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]])
    mask = packed_sequence_mask(positions, 2)[:, 0]  # (B, T, T)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(mask[1], causal)  # one run (starting at 3): plain causal
    assert torch.equal(mask[0, 3], torch.tensor([False, False, False, True, False]))
    assert torch.equal(mask[0, 2], torch.tensor([True, True, True, False, False]))


def _checkpointing(stock: tf.PreTrainedModel, fast: tf.PreTrainedModel) -> None:
    for model in (stock, fast):
        model.activation_checkpointing_enable()


def _mark_as_zero3(weight: torch.nn.Parameter) -> None:
    """Mark `weight` as ZeRO-3 marks its parameters (gathered: available)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    weight.ds_id = 0  # type: ignore[attr-defined]
    # Once a ZeRO-3 engine has run in this process, DeepSpeed's linear (which replaces
    # torch's) reads the status of every parameter marked so.
    weight.ds_status = ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]


def _zero3_partitioned(stock: tf.PreTrainedModel, fast: FastGPT2LMHeadModel) -> None:
    _mark_as_zero3(fast.transformer.wte.weight)


def _hooked(stock: tf.PreTrainedModel, fast: FastGPT2LMHeadModel) -> None:
    for model in (stock, fast):
        model.transformer.h[0].mlp.register_forward_hook(lambda module, args, out: out * 2)


def _embeds(model: tf.GPT2LMHeadModel, b: dict[str, Tensor]) -> Any:
    embeds = model.transformer.wte(b[schema.INPUT_IDS])
    return model(inputs_embeds=embeds, use_cache=False)


def _token_types(model: tf.GPT2LMHeadModel, b: dict[str, Tensor]) -> Any:
    ids = b[schema.INPUT_IDS]
    return model(input_ids=ids, token_type_ids=torch.ones_like(ids), use_cache=False)


FALLBACKS: dict[str, tuple[dict[str, Any], Callable[..., None] | None, Call]] = {
    "2d-padding-mask": ({}, None, lm_call("2d-padding")),
    "eager-attention": ({"attn": "eager"}, None, lm_call("4d-additive", "documents")),
    "kv-cache": ({}, None, lm_call(use_cache=True)),
    "config-default-cache": ({"use_cache": True}, None, lm_call(use_cache=None)),
    "checkpointing": ({}, _checkpointing, lm_call("4d-additive", "documents")),
    "zero3-weights": ({}, _zero3_partitioned, lm_call()),
    "submodule-hook": ({}, _hooked, lm_call()),
    "hidden-states": ({}, None, lm_call(output_hidden_states=True)),
    "attentions": ({"attn": "eager"}, None, lm_call(output_attentions=True)),
    "tuple-return": ({}, None, lm_call(return_dict=False)),
    "logits-to-keep": ({}, None, lm_call(logits_to_keep=T)),
    "inputs-embeds": ({}, None, _embeds),
    "token-types": ({}, None, _token_types),
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


def test_a_hook_registered_after_a_fast_forward_takes_the_stock_forward_again(
    stock_calls: list[str],
) -> None:
    stock, fast = twins()
    lm_call()(fast, batch())  # the fast path: it remembers that its walk found no hook
    assert stock_calls == []
    for model in (stock, fast):
        model.transformer.h[1].attn.c_proj.register_forward_hook(lambda m, a, out: out * 2)
    assert_same_outputs_and_grads(stock, fast, lm_call())
    assert stock_calls == ["stock"]


def test_a_hooked_module_set_after_a_fast_forward_takes_the_stock_forward_again(
    stock_calls: list[str],
) -> None:
    stock, fast = twins()
    hooked = {}
    for model in (stock, fast):  # hooked before the fast path's walk, set into the model after
        norm = copy.deepcopy(model.transformer.h[0].ln_2)
        norm.register_forward_hook(lambda m, a, out: out + 1)
        hooked[id(model)] = norm
    lm_call()(fast, batch())
    assert stock_calls == []
    for model in (stock, fast):
        model.transformer.h[0].ln_2 = hooked[id(model)]
    assert_same_outputs_and_grads(stock, fast, lm_call())
    assert stock_calls == ["stock"]


def test_generation_takes_the_stock_path_and_the_same_tokens() -> None:
    stock, fast = twins()
    ids = batch()[schema.INPUT_IDS][:1, :6]
    settings = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 1}
    expected = stock.eval().generate(ids, **settings)
    assert torch.equal(fast.eval().generate(ids, **settings), expected)


def test_dropout_uses_the_configs_probabilities_in_train_mode_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, fast = twins(attn_pdrop=0.5)
    seen: list[float] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, dropout_p: float = 0.0, **kwargs: Any) -> Tensor:
        seen.append(dropout_p)
        return sdpa(*args, dropout_p=dropout_p, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    call = lm_call("4d-additive", "documents")
    with torch.no_grad():
        first, second = call(fast, batch()).logits, call(fast, batch()).logits
        assert seen == [0.5] * 4
        assert not torch.allclose(first, second)  # the attention dropout is drawn each call
        fast.eval()
        assert torch.equal(call(fast, batch()).logits, call(fast, batch()).logits)
    assert seen[4:] == [0.0] * 4


@pytest.mark.parametrize("field", ["embd_pdrop", "resid_pdrop"])
def test_embedding_and_residual_dropout_are_active_in_train_mode_only(field: str) -> None:
    stock, fast = twins(**{field: 0.1})
    call = lm_call()
    with torch.no_grad():
        assert not torch.allclose(call(fast, batch()).logits, call(fast, batch()).logits)
        expected = call(stock.eval(), batch()).logits
        torch.testing.assert_close(call(fast.eval(), batch()).logits, expected, rtol=0, atol=1e-5)


def test_a_short_training_run_stays_with_the_stock_class(stock_calls: list[str]) -> None:
    models = twins()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    for step in range(4):
        losses = []
        for model, opt in zip(models, optimizers, strict=True):
            loss = causal_loss(model, batch(seed=step)).loss  # packed documents: a 4-D mask
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    stock, fast = (m.state_dict() for m in models)
    for name, value in stock.items():
        torch.testing.assert_close(fast[name], value, rtol=0, atol=1e-4, msg=name)
    assert stock_calls == []


@pytest.mark.parametrize("packed", [True, False], ids=["documents", "plain-causal"])
def test_a_fast_training_forward_and_backward_read_nothing_on_the_host(
    packed: bool, stock_calls: list[str]
) -> None:
    _, fast = twins(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, pad_token_id=0)
    b = batch() if packed else {schema.INPUT_IDS: batch()[schema.INPUT_IDS]}
    with count_host_reads() as reads:
        causal_loss(fast, b).loss.backward()
    assert reads == []
    assert stock_calls == []


def test_build_model_trains_the_fast_class_unless_asked_for_transformers() -> None:
    specials = {"pad": 0, "eos": 1, "vocab_size": 96}
    fast = build_model(ModelConfig(family="gpt2"), "causal", 128, specials, 32)
    stock = build_model(
        ModelConfig(family="gpt2", implementation="transformers"), "causal", 128, specials, 32
    )
    assert type(fast) is FastGPT2LMHeadModel
    assert type(stock) is tf.GPT2LMHeadModel
    assert type(as_stock(fast)) is tf.GPT2LMHeadModel


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    words = [a + b for a in ("ka", "lo", "mi", "ran", "te", "sul") for b in ("vo", "ni", "pe")]
    texts = [" ".join(rng.choices(words, k=rng.randint(4, 10))) + "." for _ in range(200)]
    cfg = TokenizerConfig(family="bpe", vocab_size=320, min_frequency=1)
    out = tmp_path_factory.mktemp("tok")
    to_transformers(train_tokenizer(texts, cfg), cfg).save_pretrained(out)
    return out
