"""Size presets of every family: published parameter counts, meta builds, tiny CPU forwards."""

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import transformers as tf

from training.models.presets import (
    FAMILIES,
    PUBLISHED,
    SIZES,
    Published,
    Value,
    electra_generator,
    preset,
)

# Each preset family's config class and the pretraining class that models.py builds for it.
CLASSES: dict[str, tuple[type[tf.PreTrainedConfig], type[tf.PreTrainedModel]]] = {
    "bert": (tf.BertConfig, tf.BertForPreTraining),
    "roberta": (tf.RobertaConfig, tf.RobertaForMaskedLM),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    "t5": (tf.T5Config, tf.T5ForConditionalGeneration),
    "albert": (tf.AlbertConfig, tf.AlbertForPreTraining),
    "distilbert": (tf.DistilBertConfig, tf.DistilBertForMaskedLM),
    "electra": (tf.ElectraConfig, tf.ElectraForPreTraining),
    "deberta": (tf.DebertaV2Config, tf.DebertaV2ForMaskedLM),
    "bart": (tf.BartConfig, tf.BartForConditionalGeneration),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
    "xlmr": (tf.XLMRobertaConfig, tf.XLMRobertaForMaskedLM),
    "longformer": (tf.LongformerConfig, tf.LongformerForMaskedLM),
    "bigbird": (tf.BigBirdConfig, tf.BigBirdForMaskedLM),
}
# DeBERTa-v3 fields that are no DebertaV2Config dataclass field: the model reads them by getattr.
DEBERTA_ATTRIBUTES = {"position_buckets", "norm_rel_ebd", "share_att_key"}
SEQ2SEQ = {"t5", "bart"}


# Tiny matmuls gain nothing from a second thread and crawl when cores are shared.
pytestmark = pytest.mark.usefixtures("one_thread")


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts tied tensors once


def make_config(family: str, fields: Mapping[str, Value]) -> tf.PreTrainedConfig:
    kwargs: dict[str, Any] = dict(fields)  # each config class types its own fields
    return CLASSES[family][0](**kwargs)


def build(family: str, size: str, vocab: int) -> tf.PreTrainedModel:
    return CLASSES[family][1](make_config(family, preset(family, size) | {"vocab_size": vocab}))


def test_presets_cover_every_family_and_size() -> None:
    assert set(FAMILIES) == set(CLASSES)
    assert all(preset(family, size) for family in FAMILIES for size in SIZES)


@pytest.mark.parametrize(("name", "published"), PUBLISHED.items(), ids=list(PUBLISHED))
def test_published_checkpoint_has_its_parameter_count(name: str, published: Published) -> None:
    config = make_config(published.family, published.fields())
    with torch.device("meta"):  # the real module, without allocating its weights
        model = getattr(tf, published.model_class)(config)
    assert count(model) == published.parameters, name


# KerasNLP's ELECTRA presets count a pooler (hidden² + hidden) that ElectraModel has not.
KERAS_ELECTRA = [
    ("discriminator", "small", 13_548_800),
    ("discriminator", "base", 109_482_240),
    ("discriminator", "large", 335_141_888),
    ("generator", "small", 13_548_800),
    ("generator", "base", 33_576_960),
    ("generator", "large", 51_065_344),
]


@pytest.mark.parametrize(("role", "size", "expected"), KERAS_ELECTRA)
def test_electra_shapes_match_the_published_kerasnlp_counts(
    role: str, size: str, expected: int
) -> None:
    fields = preset("electra", size) if role == "discriminator" else electra_generator(size)
    kwargs: dict[str, Any] = fields | {"vocab_size": 30522}
    with torch.device("meta"):
        model = tf.ElectraModel(tf.ElectraConfig(**kwargs))
    hidden = int(fields["hidden_size"])
    assert count(model) + hidden * hidden + hidden == expected


@pytest.mark.parametrize("size", SIZES)
def test_electra_generator_shares_the_discriminator_embedding_width(size: str) -> None:
    generator, discriminator = electra_generator(size), preset("electra", size)
    assert generator["embedding_size"] == discriminator["embedding_size"]
    assert int(generator["hidden_size"]) <= int(discriminator["hidden_size"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_size_builds_on_meta_and_grows_with_the_ladder(family: str) -> None:
    with torch.device("meta"):
        counts = [count(build(family, size, 32768)) for size in SIZES]
    assert counts == sorted(set(counts)), dict(zip(SIZES, counts, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_preset_key_is_a_field_of_the_config_class(family: str) -> None:
    config_class = CLASSES[family][0]
    known = {field.name for field in dataclasses.fields(config_class)}
    known |= set(config_class.attribute_map) | {"rope_theta"}  # rope_theta → rope_parameters
    for size in SIZES:
        config = make_config(family, preset(family, size))
        for key, value in preset(family, size).items():
            assert key in known or (family == "deberta" and key in DEBERTA_ATTRIBUTES), key
            if key != "pos_att_type":  # the config splits "p2c|c2p" into a list
                assert getattr(config, key) == value, (family, size, key)


def build_and_run_tiny(family: str) -> torch.Tensor:
    torch.manual_seed(0)
    input_ids = torch.randint(5, 1024, (2, 32))  # (B, T), clear of every family's special ids
    extra = {"decoder_input_ids": input_ids} if family in SEQ2SEQ else {}
    model = build(family, "tiny", 1024).train(False)
    assert count(model) < 2_000_000
    with torch.no_grad():
        outputs = model(input_ids, attention_mask=torch.ones_like(input_ids), **extra)
    logits: torch.Tensor = outputs[0]  # (B, T, V); (B, T) for the ELECTRA discriminator
    return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_builds_and_runs_a_cpu_forward(family: str) -> None:
    logits = build_and_run_tiny(family)  # also asserts the model is tiny (< 2M parameters)
    assert logits.shape[:2] == (2, 32)
    assert torch.isfinite(logits).all()


def test_tiny_layers_are_two_and_narrow() -> None:
    for family in FAMILIES:
        fields = preset(family, "tiny")
        layers = next(
            fields[k]
            for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers")
            if k in fields
        )
        width = next(fields[k] for k in ("hidden_size", "n_embd", "d_model", "dim") if k in fields)
        assert layers == 2, family
        assert int(width) == 128, family


def test_mistral_tiny_sliding_window_hides_tokens_beyond_its_reach() -> None:
    torch.manual_seed(0)
    model = build("mistral", "tiny", 1024).train(False)
    input_ids = torch.randint(5, 1024, (1, 40))  # (1, T)
    changed = input_ids.clone()
    changed[0, 0] = 5 if input_ids[0, 0] != 5 else 6
    with torch.no_grad():
        delta = (model(input_ids=input_ids).logits - model(input_ids=changed).logits).abs()
    touched = delta.amax(-1)[0] > 0  # (T,)
    # Window 16 (keys q-15..q) over 2 layers: token 0 reaches positions 0..30 and no further.
    assert touched[:31].all()
    assert not touched[31:].any()


def test_bigbird_tiny_keeps_block_sparse_attention_on_128_tokens() -> None:
    torch.manual_seed(0)
    model = build("bigbird", "tiny", 1024).train(False)
    input_ids = torch.randint(5, 1024, (2, 128))  # (B, T): over (5 + 2 * 3) * 8 = 88 tokens
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    # A sequence of 88 tokens or fewer would switch the model to full attention for good.
    assert model.bert.attention_type == "block_sparse"
    assert torch.isfinite(logits).all()


def test_deberta_preset_is_v3_relative_attention_without_absolute_positions() -> None:
    kwargs: dict[str, Any] = preset("deberta", "base")
    with torch.device("meta"):
        model = tf.DebertaV2Model(tf.DebertaV2Config(**kwargs))
    assert model.config.pos_att_type == ["p2c", "c2p"]
    assert model.embeddings.position_embeddings is None
    assert model.encoder.rel_embeddings.weight.shape == (512, 768)  # 2 x 256 position buckets


def test_longformer_window_is_even_and_mixtral_tiny_has_four_experts() -> None:
    assert all(int(preset("longformer", size)["attention_window"]) % 2 == 0 for size in SIZES)
    tiny = preset("mixtral", "tiny")
    assert (tiny["num_local_experts"], tiny["num_experts_per_tok"]) == (4, 2)


@pytest.mark.parametrize(("family", "size"), [("gpt3", "base"), ("bert", "huge")])
def test_preset_refuses_an_unknown_family_or_size(family: str, size: str) -> None:
    with pytest.raises(ValueError, match="choose one of"):
        preset(family, size)
