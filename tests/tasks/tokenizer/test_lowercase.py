"""`tokenizer.lowercase` follows the family unless set: BERT uncased, GPT-2/RoBERTa/T5 cased."""

import pytest

from tasks.common.io import public_dump
from tasks.tokenizer.tokenizer import TokenizerConfig, lowercases, train_tokenizer

SENTENCES = ["Tavor lives in Oslo.", "Mira lives in Lima.", "The tired dogs sleep."] * 30
CASES = [
    ({"family": "wordpiece"}, True),
    ({"family": "bpe"}, False),
    ({"family": "bpe", "bpe_style": "roberta"}, False),
    ({"family": "unigram"}, False),
]


@pytest.mark.parametrize(("family", "lowered"), CASES, ids=lambda c: str(c))
def test_lowercase_defaults_to_the_familys_convention(
    family: dict[str, str], lowered: bool
) -> None:
    cfg = TokenizerConfig.model_validate(family)
    assert cfg.lowercase is lowered
    assert lowercases(cfg) is lowered


@pytest.mark.parametrize("family", ["wordpiece", "bpe", "unigram"])
@pytest.mark.parametrize("lowercase", [True, False])
def test_an_explicit_lowercase_is_kept_whatever_the_family(family: str, lowercase: bool) -> None:
    assert TokenizerConfig.model_validate({"family": family, "lowercase": lowercase}).lowercase is (
        lowercase
    )


@pytest.mark.parametrize(("family", "lowered"), CASES, ids=lambda c: str(c))
def test_the_default_and_the_same_explicit_value_give_the_same_fingerprint_input(
    family: dict[str, str], lowered: bool
) -> None:
    # `plan_tokenizer` fingerprints `public_dump(cfg)`: a recipe that spells the value out (as
    # recipes written before the family default did) keeps its tokenizer output.
    default = TokenizerConfig.model_validate(family)
    explicit = TokenizerConfig.model_validate({**family, "lowercase": lowered})
    assert public_dump(default) == public_dump(explicit)
    assert TokenizerConfig.model_validate(default.model_dump()) == explicit


def test_the_resolved_default_is_not_a_set_field() -> None:
    # A deployment's parameters keep only the fields a recipe set (pipelines/ops/deployments.py),
    # so a run from Prefect's form with another family gets that family's default.
    assert "lowercase" not in TokenizerConfig(family="bpe").model_fields_set
    assert "lowercase" in TokenizerConfig(family="bpe", lowercase=True).model_fields_set


@pytest.mark.parametrize(
    ("family", "decoded"),
    [
        ({"family": "wordpiece"}, "tavor lives in oslo ."),
        ({"family": "bpe"}, "Tavor lives in Oslo."),
        ({"family": "bpe", "bpe_style": "roberta"}, "Tavor lives in Oslo."),
        ({"family": "unigram", "extra_ids": 4}, "Tavor lives in Oslo."),
    ],
    ids=["wordpiece", "bpe-gpt2", "bpe-roberta", "unigram"],
)
def test_a_default_tokenizer_keeps_case_unless_it_is_wordpiece(
    family: dict[str, object], decoded: str
) -> None:
    cfg = TokenizerConfig.model_validate({"vocab_size": 200, "min_frequency": 1, **family})
    tok = train_tokenizer(iter(SENTENCES), cfg)
    ids = tok.encode("Tavor lives in Oslo.", add_special_tokens=False).ids
    assert tok.decode(ids) == decoded
