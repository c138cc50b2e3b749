"""Family/size registry: published parameter counts, presets, overrides and objective checks."""

from pathlib import Path
from typing import get_args

import pytest
import torch
import transformers as tf

from training.models.models import (
    FAMILIES as MODEL_FAMILIES,
)
from training.models.models import (
    OBJECTIVES,
    Family,
    ModelConfig,
    ModelConfigError,
    ObjectiveMismatchError,
    Size,
    auto_class,
    build_model,
    check_objective,
    count_parameters,
    family_of,
    is_a,
    model_class,
    model_config_for,
)

# Special ids as an examples manifest holds them, for a 1,024-token tokenizer.
SPECIALS: dict[str, int | None] = {
    "cls": 2,
    "sep": 3,
    "pad": 0,
    "mask": 4,
    "eos": 3,
    "sentinel_top": 1023,
    "vocab_size": 1024,
}
OBJECTIVE = {family: objectives[0] for family, objectives in OBJECTIVES.items()}
FAMILIES: tuple[Family, ...] = get_args(Family)


def published(family: Family, size: Size, vocab: int, pad: int, eos: int) -> tf.PreTrainedConfig:
    specials = {"pad": pad, "eos": eos, "cls": 0, "vocab_size": vocab}
    # The published checkpoints' own vocabularies, unpadded.
    cfg = ModelConfig(family=family, size=size, pad_vocab_to_multiple_of=1)
    return model_config_for(cfg, vocab, specials, 512)


@pytest.mark.parametrize(
    ("family", "size", "vocab", "pad", "expected"),
    [
        ("bert", "base", 30522, 0, 109_482_240),  # bert-base-uncased BertModel
        ("bert", "large", 30522, 0, 335_141_888),  # bert-large-uncased BertModel
        ("roberta", "base", 50265, 1, 124_645_632),  # roberta-base RobertaModel
    ],
)
def test_encoder_presets_match_published_bert_and_roberta_counts(
    family: Family, size: Size, vocab: int, pad: int, expected: int
) -> None:
    config = published(family, size, vocab, pad, eos=2)
    encoder_class = tf.BertModel if family == "bert" else tf.RobertaModel
    with torch.device("meta"):  # the real module, without allocating its weights
        encoder = encoder_class(config)
    assert count_parameters(encoder) == expected


@pytest.mark.parametrize(
    ("family", "size", "vocab", "expected"),
    [
        ("bert", "base", 30522, 110_106_428),  # BertForPreTraining: + MLM transform, NSP head
        ("gpt2", "base", 50257, 124_439_808),  # GPT-2 "small" (124M), LM head tied
        ("gpt2", "large", 50257, 774_030_080),  # GPT-2 "large" (774M)
        ("t5", "small", 32128, 60_506_624),  # t5-small, LM head tied to the shared embedding
        ("t5", "base", 32128, 222_903_552),
        ("t5", "large", 32128, 737_668_096),
    ],
)
def test_pretraining_models_match_published_counts(
    family: Family, size: Size, vocab: int, expected: int
) -> None:
    specials = {"pad": 0, "eos": 1, "vocab_size": vocab}
    with torch.device("meta"):
        model = build_model(
            ModelConfig(family=family, size=size, pad_vocab_to_multiple_of=1),
            OBJECTIVE[family],
            vocab,
            specials,
            512,
        )
    assert count_parameters(model) == expected


def test_t5_presets_are_the_published_v1_0_shapes() -> None:
    small = published("t5", "small", 32128, 0, 1)
    assert (small.d_model, small.d_ff, small.num_layers, small.num_decoder_layers) == (
        512,
        2048,
        6,
        6,
    )
    assert (small.num_heads, small.d_kv, small.relative_attention_num_buckets) == (8, 64, 32)
    assert small.feed_forward_proj == "relu"
    base, large = published("t5", "base", 32128, 0, 1), published("t5", "large", 32128, 0, 1)
    assert (base.d_model, base.d_ff, base.num_layers, base.num_heads) == (768, 3072, 12, 12)
    assert (large.d_model, large.d_ff, large.num_layers, large.num_heads) == (1024, 4096, 24, 16)


def test_roberta_preset_has_pad_offset_positions_and_one_token_type() -> None:
    config = published("roberta", "base", 50265, 1, 2)
    assert (config.max_position_embeddings, config.type_vocab_size) == (514, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tiny_model_builds_with_at_most_a_few_million_parameters(family: Family) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(family=family), OBJECTIVE[family], 1024, SPECIALS, 128)
    assert isinstance(model, model_class(family))
    assert 50_000 <= count_parameters(model) <= 3_000_000
    # SDPA everywhere, except the families transformers has no SDPA path for.
    expected = "eager" if family in ("deberta-v2", "longformer", "big_bird") else "sdpa"
    assert model.config._attn_implementation == expected == MODEL_FAMILIES[family].attention


def test_overrides_win_over_the_preset_and_the_dropout() -> None:
    cfg = ModelConfig(
        family="bert",
        size="base",
        dropout=0.0,
        overrides={"num_hidden_layers": 4, "attention_probs_dropout_prob": 0.2},
    )
    config = model_config_for(cfg, 1024, SPECIALS, 128)
    assert (config.num_hidden_layers, config.hidden_size) == (4, 768)
    assert (config.hidden_dropout_prob, config.attention_probs_dropout_prob) == (0.0, 0.2)


def test_dropout_reaches_every_dropout_field_of_gpt2() -> None:
    config = model_config_for(ModelConfig(family="gpt2", dropout=0.3), 1024, SPECIALS, 128)
    assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.3, 0.3, 0.3)


def test_gpt2_accepts_the_generic_alias_of_its_fields() -> None:
    cfg = ModelConfig(family="gpt2", overrides={"max_position_embeddings": 256})
    assert model_config_for(cfg, 1024, SPECIALS, 128).n_positions == 256


def test_unknown_override_key_is_refused_with_its_name_and_a_suggestion() -> None:
    cfg = ModelConfig(family="llama", overrides={"num_hiden_layers": 4})
    with pytest.raises(
        ModelConfigError, match=r"model\.overrides\.num_hiden_layers .*num_hidden_layers"
    ):
        model_config_for(cfg, 1024, SPECIALS, 128)


def test_ill_typed_override_is_refused() -> None:
    cfg = ModelConfig(family="bert", overrides={"hidden_size": "wide"})
    with pytest.raises(ModelConfigError, match="hidden_size"):
        model_config_for(cfg, 1024, SPECIALS, 128)


def test_model_section_rejects_unknown_fields_and_bad_dropout() -> None:
    with pytest.raises(ValueError, match="extra"):
        ModelConfig.model_validate({"family": "bert", "layers": 2})
    with pytest.raises(ValueError, match="dropout"):
        ModelConfig(dropout=1.5)


def test_mismatched_objective_is_refused_with_what_the_family_accepts() -> None:
    expected = (
        "model family 't5' cannot train on 'causal' examples: t5 trains on span_corruption; "
        "set model.family to gpt2 or llama or mistral or mixtral for causal"
    )
    with pytest.raises(ObjectiveMismatchError) as caught:
        build_model(ModelConfig(family="t5"), "causal", 1024, SPECIALS, 128)
    assert str(caught.value) == expected


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "objective", ["bert", "sop", "roberta", "causal", "span_corruption", "denoising"]
)
def test_each_family_accepts_exactly_its_objectives(family: Family, objective: str) -> None:
    if objective in OBJECTIVES[family]:
        check_objective(family, objective)
    else:
        with pytest.raises(ObjectiveMismatchError, match=f"{family} trains on"):
            check_objective(family, objective)


def test_unknown_objective_lists_the_known_ones() -> None:
    with pytest.raises(ObjectiveMismatchError, match="must be one of"):
        check_objective("bert", "prefix_lm")


@pytest.mark.parametrize(
    ("family", "max_length", "field"),
    [
        ("bert", 513, "max_position_embeddings"),
        ("roberta", 513, "max_position_embeddings"),  # 514 rows hold 512 after the pad offset
        ("gpt2", 1025, "n_positions"),
        ("llama", 2049, "max_position_embeddings"),
    ],
)
def test_examples_longer_than_the_positions_are_refused(
    family: Family, max_length: int, field: str
) -> None:
    specials = SPECIALS | {"pad": 1}
    cfg = ModelConfig(family=family)
    model_config_for(cfg, 1024, specials, max_length - 1)  # one less fits
    with pytest.raises(ModelConfigError, match=rf"model\.overrides\.{field}"):
        model_config_for(cfg, 1024, specials, max_length)


def test_t5_has_no_position_limit() -> None:
    assert model_config_for(ModelConfig(family="t5"), 1024, SPECIALS, 4096).d_model == 128


def test_special_ids_come_from_the_tokenizer_not_hub_defaults() -> None:
    gpt2 = model_config_for(ModelConfig(family="gpt2"), 1024, SPECIALS, 128)
    assert (gpt2.bos_token_id, gpt2.eos_token_id, gpt2.pad_token_id) == (3, 3, 0)
    t5 = model_config_for(ModelConfig(family="t5"), 1024, SPECIALS, 128)
    assert (t5.pad_token_id, t5.eos_token_id, t5.decoder_start_token_id) == (0, 3, 0)
    roberta = model_config_for(ModelConfig(family="roberta"), 1024, SPECIALS | {"pad": 1}, 128)
    assert (roberta.bos_token_id, roberta.eos_token_id, roberta.pad_token_id) == (2, 3, 1)


def test_vocabulary_smaller_than_the_tokenizer_is_refused() -> None:
    with pytest.raises(ModelConfigError, match="smaller than the tokenizer's 1024"):
        model_config_for(ModelConfig(), 1000, SPECIALS, 128)


def test_activation_checkpointing_is_enabled_when_asked() -> None:
    cfg = ModelConfig(family="llama", activation_checkpointing=True)
    assert build_model(cfg, "causal", 1024, SPECIALS, 128).is_activation_checkpointing
    plain = build_model(ModelConfig(family="llama"), "causal", 1024, SPECIALS, 128)
    assert not plain.is_activation_checkpointing


@pytest.mark.parametrize("family", FAMILIES)
def test_export_reloads_with_its_auto_class(family: Family, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(family=family), OBJECTIVE[family], 1024, SPECIALS, 128)
    model.save_pretrained(tmp_path)
    reloaded = auto_class(family).from_pretrained(tmp_path)
    assert type(reloaded) is model_class(family)  # the stock class, also for a fast module
    assert family_of(reloaded.config) == family
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_deberta_fields_read_by_getattr_are_accepted_as_overrides() -> None:
    cfg = ModelConfig(family="deberta", overrides={"position_buckets": 128})
    assert model_config_for(cfg, 1024, SPECIALS, 128).position_buckets == 128
    with pytest.raises(ModelConfigError, match="did you mean position_buckets"):
        model_config_for(
            ModelConfig(family="deberta", overrides={"position_bucket": 128}), 1024, SPECIALS, 128
        )


def test_is_a_answers_isinstance_by_class_name_and_identity() -> None:
    config = tf.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2)
    model = tf.BertForMaskedLM(config)

    class Mine(tf.BertForMaskedLM):  # a subclass is an instance, as for isinstance
        pass

    class BertForPreTraining(torch.nn.Module):  # the name alone is not enough
        pass

    assert is_a(model, "BertForMaskedLM")
    assert is_a(Mine(config), "BertForMaskedLM")
    assert is_a(model, "PreTrainedModel")
    assert not is_a(model, "LongformerForMaskedLM")
    assert not is_a(BertForPreTraining(), "BertForPreTraining")
    assert is_a(config, "BertConfig")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_names_its_classes_and_family_of_finds_it(family: Family) -> None:
    spec = MODEL_FAMILIES[family]
    assert (spec.config.__name__, spec.model.__name__) == (spec.config_name, spec.model_name)
    assert spec.auto.__name__ == spec.auto_name
    assert family_of(spec.config()) == family
