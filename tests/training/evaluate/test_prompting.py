"""Zero/few-shot classification by prompting, and seeded batched generation, on tiny models."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest
import torch
import transformers as tf

from tasks.common.schema import downstream_schema
from tasks.tokenizer.tokenizer import TokenizerConfig, to_transformers, train_tokenizer
from training.evaluate.prompting import (
    PromptConfig,
    build_prompts,
    classify_by_prompting,
    score_continuations,
    to_text_to_text,
)
from training.finetune.features.features import FeatureConfig, featurize_causal_lm, make_collator
from training.scoring.generation import GenerationSettings, generate_texts

WORDS = [a + b for a in ("ka", "lo", "mi", "ran", "te", "sul") for b in ("vo", "ni", "pe")]
LABELS = ["neg", "pos"]
CFG = PromptConfig(
    template="Review: {text}\nSentiment:", verbalizers={"neg": " bad", "pos": " good"}
)


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(n)]


@pytest.fixture(scope="module")
def gpt2() -> tuple[tf.PreTrainedModel, tf.PreTrainedTokenizerBase]:
    """A seeded 2-layer GPT-2 (width 32) and a byte-level BPE tokenizer (no pad token)."""
    cfg = TokenizerConfig(family="bpe", vocab_size=300, min_frequency=1)
    corpus = [*sentences(200), "review: sentiment: good bad very a b c d e"]
    tok = to_transformers(train_tokenizer(corpus, cfg), cfg)
    torch.manual_seed(0)
    eos = tok.eos_token_id
    config = tf.GPT2Config(
        vocab_size=len(tok),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=128,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    return tf.GPT2LMHeadModel(config).eval(), tok


@pytest.fixture(scope="module")
def t5() -> tuple[tf.PreTrainedModel, tf.PreTrainedTokenizerBase]:
    cfg = TokenizerConfig(family="unigram", vocab_size=120, extra_ids=2, min_frequency=1)
    tok = to_transformers(train_tokenizer([*sentences(200), "good bad review"], cfg), cfg)
    torch.manual_seed(0)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    shape = {"d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2, "num_heads": 2}
    config = tf.T5Config(
        vocab_size=len(tok), pad_token_id=pad, eos_token_id=eos, decoder_start_token_id=pad, **shape
    )
    return tf.T5ForConditionalGeneration(config).eval(), tok


def table(texts: list[str], labels: list[int]) -> pa.Table:
    return pa.table(
        {"example_id": [f"r{i}" for i in range(len(texts))], "text": texts, "label": labels},
        schema=downstream_schema("classification"),
    )


def loss_sum(model: tf.PreTrainedModel, tok: tf.PreTrainedTokenizerBase, prompt: str, cont: str):
    """Summed log-probability of `cont` after `prompt`, through transformers' own loss."""
    context = tok(prompt, add_special_tokens=False)["input_ids"]
    target = tok(cont, add_special_tokens=False)["input_ids"]
    if model.config.is_encoder_decoder:
        out = model(
            input_ids=tok(prompt, return_tensors="pt")["input_ids"], labels=torch.tensor([target])
        )
    else:
        ids = torch.tensor([context + target])
        out = model(input_ids=ids, labels=torch.tensor([[-100] * len(context) + target]))
    return -float(out.loss.detach()) * len(target)  # the loss is the mean over the target tokens


def test_label_scores_are_verbalizer_log_probabilities_and_prediction_is_their_argmax(
    gpt2: tuple[tf.PreTrainedModel, tf.PreTrainedTokenizerBase],
) -> None:
    model, tok = gpt2
    texts = sentences(5, seed=1)
    cfg = PromptConfig(template=CFG.template, verbalizers={"neg": " bad", "pos": " very good"})
    result = classify_by_prompting(model, tok, table(texts, [0, 1, 0, 1, 0]), LABELS, cfg)
    expected = [
        [loss_sum(model, tok, p, v) for v in (" bad", " very good")] for p in result.prompts
    ]
    np.testing.assert_allclose(result.scores, expected, rtol=1e-5)
    assert result.predictions.tolist() == np.argmax(expected, axis=1).tolist()
    np.testing.assert_allclose(result.probabilities().sum(axis=1), 1.0)
    assert result.prompts[0] == f"Review: {texts[0]}\nSentiment:"


def test_mean_normalisation_divides_each_score_by_its_verbalizer_length(
    gpt2: tuple[tf.PreTrainedModel, tf.PreTrainedTokenizerBase],
) -> None:
    model, tok = gpt2
    prompts, conts = ["Review: kavo\nSentiment:"], [" bad", " very good"]
    summed = score_continuations(model, tok, prompts, conts, "sum")
    mean = score_continuations(model, tok, prompts, conts, "mean", batch_size=1)
    lengths = [len(tok(c, add_special_tokens=False)["input_ids"]) for c in conts]
    assert lengths[1] > 1
    np.testing.assert_allclose(mean, summed / np.asarray(lengths), rtol=1e-5)


def test_few_shot_prompts_hold_exactly_k_demonstrations_never_the_query() -> None:
    texts = sentences(12, seed=2)
    labels = [i % 2 for i in range(12)]
    queries = table(texts, labels)
    train = table([*texts, texts[0]], [*labels, 1])  # the same rows, plus a copy of query 0
    cfg = CFG.model_copy(update={"k_shot": 3, "seed": 5})
    prompts, demos = build_prompts(queries, LABELS, cfg, train)
    for i, (prompt, shown) in enumerate(zip(prompts, demos, strict=True)):
        assert len(shown) == len(set(shown)) == 3
        assert i not in shown  # never the query itself ...
        assert all(texts[j] != texts[i] for j in shown if j < 12)  # ... nor a copy of it
        assert 12 not in shown or i != 0
        blocks = prompt.split("\n\n")
        assert len(blocks) == 4
        assert blocks[-1] == f"Review: {texts[i]}\nSentiment:"
        for block, j in zip(blocks[:-1], shown, strict=True):
            verbalizer = " good" if train.column("label")[j].as_py() else " bad"
            assert block == f"Review: {train.column('text')[j].as_py()}\nSentiment:{verbalizer}"
    assert build_prompts(queries, LABELS, cfg, train) == (prompts, demos)
    other = build_prompts(queries, LABELS, cfg.model_copy(update={"seed": 6}), train)
    assert other[1] != demos


def test_prompting_refuses_bad_verbalizers_and_too_few_demonstrations() -> None:
    queries = table(sentences(3), [0, 1, 0])
    wrong = {"neg": " bad", "positive": " x"}
    with pytest.raises(ValueError, match=r"missing \['pos'\], unknown \['positive'\]"):
        build_prompts(queries, LABELS, CFG.model_copy(update={"verbalizers": wrong}))
    with pytest.raises(ValueError, match="only 2 train examples can be demonstrations"):
        build_prompts(queries, LABELS, CFG.model_copy(update={"k_shot": 3}), queries)
    with pytest.raises(ValueError, match="needs a train table"):
        build_prompts(queries, LABELS, CFG.model_copy(update={"k_shot": 1}))


def test_t5_scores_verbalizers_as_decoder_targets(
    t5: tuple[tf.PreTrainedModel, tf.PreTrainedTokenizerBase],
) -> None:
    model, tok = t5
    result = classify_by_prompting(model, tok, table(sentences(3), [0, 1, 1]), LABELS, CFG)
    expected = [[loss_sum(model, tok, p, v) for v in (" bad", " good")] for p in result.prompts]
    np.testing.assert_allclose(result.scores, expected, rtol=1e-5)


def test_classification_table_becomes_text_to_text() -> None:
    seq2seq = to_text_to_text(table(["kavo", "lopi"], [1, 0]), LABELS, CFG)
    assert seq2seq.schema == downstream_schema("seq2seq")
    assert seq2seq.column("text").to_pylist() == [
        "Review: kavo\nSentiment:",
        "Review: lopi\nSentiment:",
    ]
    assert seq2seq.column("target").to_pylist() == ["good", "bad"]


def test_sampling_is_reproducible_with_its_seed_and_leaves_the_global_rng_alone(
    gpt2: tuple[tf.PreTrainedModel, tf.PreTrainedTokenizerBase],
) -> None:
    model, tok = gpt2
    prompts = sentences(6, seed=3)
    sample = GenerationSettings(
        strategy="sample",
        top_k=50,
        top_p=0.95,
        temperature=1.5,
        max_new_tokens=8,
        seed=11,
        batch_size=4,
    )
    torch.manual_seed(0)
    first = generate_texts(model, tok, prompts, sample)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert generate_texts(model, tok, prompts, sample) == first
    assert torch.equal(torch.rand(1), after)
    assert generate_texts(model, tok, prompts, sample.model_copy(update={"seed": 12})) != first


def test_greedy_batches_padded_on_the_left_decode_like_single_prompts(
    gpt2: tuple[tf.PreTrainedModel, tf.PreTrainedTokenizerBase],
) -> None:
    model, tok = gpt2
    prompts = ["kavo", "kavo lopi mini ransul tepe", "mivo te"]  # different lengths
    greedy = GenerationSettings(max_new_tokens=6, batch_size=3)
    batched = generate_texts(model, tok, prompts, greedy)
    alone = generate_texts(model, tok, prompts, greedy.model_copy(update={"batch_size": 1}))
    assert batched == alone
    beams = generate_texts(model, tok, prompts, greedy.model_copy(update={"num_beams": 3}))
    assert len(beams) == 3
    assert all(isinstance(text, str) for text in beams)


def test_t5_generates_from_its_source(
    t5: tuple[tf.PreTrainedModel, tf.PreTrainedTokenizerBase],
) -> None:
    model, tok = t5
    settings = GenerationSettings(max_new_tokens=5, batch_size=2)
    texts = generate_texts(model, tok, ["summarize: kavo lopi", "summarize: mi", "te"], settings)
    assert len(texts) == 3
    assert texts == generate_texts(
        model,
        tok,
        ["summarize: kavo lopi", "summarize: mi", "te"],
        settings.model_copy(update={"batch_size": 1}),
    )


@pytest.mark.slow
def test_a_model_fine_tuned_on_responses_generates_them_and_stops_at_eos(
    gpt2: tuple[tf.PreTrainedModel, tf.PreTrainedTokenizerBase],
) -> None:
    _, tok = gpt2
    torch.manual_seed(1)
    model = tf.GPT2LMHeadModel(
        tf.GPT2Config(
            vocab_size=len(tok),
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    pairs = pa.table(
        {"example_id": ["x", "y"], "prompt": ["a b", "kavo"], "response": [" c d e", " lopi"]},
        schema=downstream_schema("causal_lm"),
    )
    features = featurize_causal_lm(pairs, tok, FeatureConfig())
    batch = make_collator("causal_lm", tok)([features[0], features[1]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(60):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    texts = generate_texts(model, tok, ["a b", "kavo"], GenerationSettings(max_new_tokens=10))
    assert texts == ["c d e", "lopi"]
    assert model.training  # generate_texts put it back in train mode
