"""Model families and named sizes over `transformers` classes; objective ↔ family checks.

Every model we pretrain is a stock `transformers` class built from a config, so each export
reloads with `from_pretrained` (see `auto_class`). This module maps a family and a named size
to that config, fills in the tokenizer's special ids and checks that the examples fit the model.
It holds no training logic and never imports Ray, DeepSpeed or MLflow; the loss lives in
`training/pretrain/losses/`. Sizes and the published-count check are documented in docs/models.md.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Literal

import torch
import transformers as tf
from huggingface_hub.errors import StrictDataclassError

from tasks.common.schema import ObjectiveMismatchError
from training.models import presets
from training.models.attention import DOCUMENT_FLEX, register_document_flex
from training.models.bias import drop_biases
from training.models.config import ALIASES as ALIASES
from training.models.config import DocumentAttention
from training.models.config import Family as Family
from training.models.config import ModelConfig as ModelConfig
from training.models.config import Size as Size
from training.models.config import Value as Value
from training.models.fast import fast_class
from training.models.vocab import pad_vocab

Kind = Literal["encoder", "decoder", "seq2seq"]

#: Attention kernel of every model we build: unlike flash attention, SDPA (like eager) honours
#: the custom 4-D document mask of packed causal blocks (training/pretrain/packing.py).
#: `train.attention` flex swaps in FlexAttention for those blocks (training/models/attention.py).
ATTENTION = "sdpa"


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One family: its transformers classes, the examples it trains on, and its kind.

    The classes are held by name and resolved on first use (`config`, `model`, `auto`): a
    family's modeling module costs 0.1-0.5 s to import, and a process (a Ray Train worker
    above all) builds one family, not the fifteen.
    """

    config_name: str  # the transformers config class
    model_name: str  # the pretraining class (what an export holds)
    auto_name: str  # the Auto class that reloads an export
    objectives: tuple[str, ...]
    kind: Kind
    preset: str  # its name in training/models/presets.py
    dropouts: tuple[str, ...]
    positions: str | None  # the config field of the position table; None: no table to overflow
    attention: str = ATTENTION

    @property
    def config(self) -> type[tf.PreTrainedConfig]:
        """The family's transformers config class."""
        return getattr(tf, self.config_name)  # type: ignore[no-any-return]

    @property
    def model(self) -> type[tf.PreTrainedModel]:
        """The family's pretraining class (what an export holds)."""
        return getattr(tf, self.model_name)  # type: ignore[no-any-return]

    @property
    def auto(self) -> type[Any]:
        """The `AutoModelFor...` class that reloads an export."""
        return getattr(tf, self.auto_name)  # type: ignore[no-any-return]


_BERT_DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob")
_ROPE_DROPOUTS = ("attention_dropout",)
_POS = "max_position_embeddings"

FAMILIES: dict[Family, FamilySpec] = {
    "bert": FamilySpec(
        "BertConfig",
        "BertForPreTraining",
        "AutoModelForPreTraining",
        ("bert", "sop"),
        "encoder",
        "bert",
        _BERT_DROPOUTS,
        _POS,
    ),  # SOP reuses BERT's binary next-sentence head
    "roberta": FamilySpec(
        "RobertaConfig",
        "RobertaForMaskedLM",
        "AutoModelForMaskedLM",
        ("roberta",),
        "encoder",
        "roberta",
        _BERT_DROPOUTS,
        _POS,
    ),
    "gpt2": FamilySpec(
        "GPT2Config",
        "GPT2LMHeadModel",
        "AutoModelForCausalLM",
        ("causal",),
        "decoder",
        "gpt2",
        ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
        "n_positions",
    ),
    "llama": FamilySpec(
        "LlamaConfig",
        "LlamaForCausalLM",
        "AutoModelForCausalLM",
        ("causal",),
        "decoder",
        "llama",
        _ROPE_DROPOUTS,
        _POS,
    ),
    "t5": FamilySpec(
        "T5Config",
        "T5ForConditionalGeneration",
        "AutoModelForSeq2SeqLM",
        ("span_corruption",),
        "seq2seq",
        "t5",
        ("dropout_rate",),
        None,
    ),
    "albert": FamilySpec(
        "AlbertConfig",
        "AlbertForPreTraining",
        "AutoModelForPreTraining",
        ("sop",),
        "encoder",
        "albert",
        (*_BERT_DROPOUTS, "classifier_dropout_prob"),
        _POS,
    ),
    "distilbert": FamilySpec(
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        "AutoModelForMaskedLM",
        ("roberta",),
        "encoder",
        "distilbert",
        ("dropout", "attention_dropout"),
        _POS,
    ),
    # The discriminator is the model; its generator lives in training/models/electra.py.
    "electra": FamilySpec(
        "ElectraConfig",
        "ElectraForPreTraining",
        "AutoModelForPreTraining",
        ("roberta",),
        "encoder",
        "electra",
        _BERT_DROPOUTS,
        _POS,
    ),
    "deberta-v2": FamilySpec(
        "DebertaV2Config",
        "DebertaV2ForMaskedLM",
        "AutoModelForMaskedLM",
        ("roberta",),
        "encoder",
        "deberta",
        _BERT_DROPOUTS,
        None,  # relative positions only
        "eager",  # disentangled attention has no SDPA path
    ),
    "bart": FamilySpec(
        "BartConfig",
        "BartForConditionalGeneration",
        "AutoModelForSeq2SeqLM",
        ("denoising",),
        "seq2seq",
        "bart",
        ("dropout", "attention_dropout", "activation_dropout"),
        _POS,
    ),
    "mistral": FamilySpec(
        "MistralConfig",
        "MistralForCausalLM",
        "AutoModelForCausalLM",
        ("causal",),
        "decoder",
        "mistral",
        _ROPE_DROPOUTS,
        _POS,
    ),
    "mixtral": FamilySpec(
        "MixtralConfig",
        "MixtralForCausalLM",
        "AutoModelForCausalLM",
        ("causal",),
        "decoder",
        "mixtral",
        _ROPE_DROPOUTS,
        _POS,
    ),
    "xlm-roberta": FamilySpec(
        "XLMRobertaConfig",
        "XLMRobertaForMaskedLM",
        "AutoModelForMaskedLM",
        ("roberta",),
        "encoder",
        "xlmr",
        _BERT_DROPOUTS,
        _POS,
    ),
    # Longformer and BigBird have no SDPA path: their sparse attention is their own kernel.
    "longformer": FamilySpec(
        "LongformerConfig",
        "LongformerForMaskedLM",
        "AutoModelForMaskedLM",
        ("roberta",),
        "encoder",
        "longformer",
        _BERT_DROPOUTS,
        _POS,
        "eager",
    ),
    "big_bird": FamilySpec(
        "BigBirdConfig",
        "BigBirdForMaskedLM",
        "AutoModelForMaskedLM",
        ("roberta",),
        "encoder",
        "bigbird",
        _BERT_DROPOUTS,
        _POS,
        "eager",
    ),
}

#: The example objectives (`examples.objective`) each family trains on.
OBJECTIVES: dict[str, tuple[str, ...]] = {name: spec.objectives for name, spec in FAMILIES.items()}
#: The objectives whose loss is a masked-LM loss (a pair loss beside it for bert and sop).
MLM_OBJECTIVES = ("bert", "sop", "roberta")
#: The encoder-decoder objectives, with the name of their batch layout.
SEQ2SEQ_OBJECTIVES = {"span_corruption": "span", "denoising": "denoise"}
#: Families whose position ids start after the pad id (fairseq's numbering).
PAD_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "longformer"})


class ModelConfigError(ValueError):
    """The model section (size, overrides) does not fit the tokenizer or the examples."""


def check_objective(family: Family, objective: str) -> None:
    """Refuse examples that `family` cannot train on.

    Raises:
        ObjectiveMismatchError: naming both, what the family accepts and which families fit.
    """
    accepted = OBJECTIVES[family]
    if objective in accepted:
        return
    fits = [name for name, objectives in OBJECTIVES.items() if objective in objectives]
    known = sorted({name for objectives in OBJECTIVES.values() for name in objectives})
    hint = (
        f"set model.family to {' or '.join(fits)} for {objective}"
        if fits
        else f"examples.objective must be one of {known}"
    )
    raise ObjectiveMismatchError(
        f"model family {family!r} cannot train on {objective!r} examples: "
        f"{family} trains on {' or '.join(accepted)}; {hint}"
    )


def is_a(obj: object, class_name: str) -> bool:
    """`isinstance(obj, getattr(transformers, class_name))`, without importing that class.

    Only a class in `obj`'s MRO with that name is resolved: a check against a family this
    process never built then costs nothing, not its modeling module's import.
    """
    return any(
        cls.__name__ == class_name and cls is getattr(tf, class_name) for cls in type(obj).__mro__
    )


def model_class(family: Family) -> type[tf.PreTrainedModel]:
    """The `transformers` pretraining class of `family` (e.g. `BertForPreTraining`)."""
    return FAMILIES[family].model


def family_of(config: tf.PreTrainedConfig) -> Family:
    """The family of a config built here (its `model_type`).

    Raises:
        ModelConfigError: the config is of another model type.
    """
    name = type(config).__name__
    for family, spec in FAMILIES.items():
        # exact: no subclass of another family (by name first: no other family's import)
        if name == spec.config_name and type(config) is spec.config:
            return family
    raise ModelConfigError(f"{type(config).__name__} is none of the families {list(FAMILIES)}")


def auto_class(family: Family) -> type[Any]:
    """The `AutoModelFor...` class that reloads an export of `family` with `from_pretrained`."""
    return FAMILIES[family].auto


def kind_of(family: str) -> Kind:
    """encoder, decoder or seq2seq; an unknown family (a model_type) raises KeyError."""
    return FAMILIES[family].kind  # type: ignore[index]


def _special_fields(family: Family, specials: Mapping[str, int | None]) -> dict[str, int | None]:
    """Config fields for the tokenizer's special ids (never transformers' hub defaults)."""
    pad, eos, cls, sep = (specials.get(k) for k in ("pad", "eos", "cls", "sep"))
    kind = FAMILIES[family].kind
    if kind == "decoder":  # causal blocks hold only eos (as document separator)
        return {"pad_token_id": pad, "bos_token_id": eos, "eos_token_id": eos}
    if family == "t5":
        return {"pad_token_id": pad, "eos_token_id": eos, "decoder_start_token_id": pad}
    if family == "bart":  # BART starts decoding with </s>, then <s>
        return {
            "pad_token_id": pad,
            "bos_token_id": cls,
            "eos_token_id": eos,
            "decoder_start_token_id": eos,
            "forced_eos_token_id": eos,
        }
    if family in ("bert", "distilbert", "electra", "deberta-v2"):
        return {"pad_token_id": pad}
    fields = {"pad_token_id": pad, "bos_token_id": cls, "eos_token_id": eos if eos else sep}
    if family in ("longformer", "big_bird"):
        fields["sep_token_id"] = sep if sep is not None else eos  # their QA global attention
    return fields


def _check_overrides(family: Family, overrides: Mapping[str, Value]) -> None:
    """Refuse override keys that are not fields of the family's transformers config."""
    config_class = FAMILIES[family].config
    # transformers 5 configs are strict dataclasses but silently keep unknown kwargs as
    # attributes, so a misspelled key would otherwise be ignored by the model.
    known = {field.name for field in dataclasses.fields(config_class)}
    known |= {"decoder_start_token_id", *config_class.attribute_map}  # aliases: GPT-2 hidden_size
    # Fields a model reads by getattr, not declared by its config class (DeBERTa-v3's
    # position_buckets, norm_rel_ebd, share_att_key): the presets set them, so may the user.
    known |= set(presets.preset(FAMILIES[family].preset, "base"))
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ModelConfigError(
                f"model.overrides.{key} is not a field of {config_class.__name__} "
                f"(model.family={family}){hint}"
            )


def _check_fits(
    family: Family, config: tf.PreTrainedConfig, specials: Mapping[str, int | None], max_length: int
) -> None:
    """Check the vocabulary holds the tokenizer and the positions hold `max_length` tokens."""
    tokenizer_vocab = specials.get("vocab_size")
    if tokenizer_vocab is not None and config.vocab_size < tokenizer_vocab:
        raise ModelConfigError(
            f"vocab_size {config.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}"
        )
    field = FAMILIES[family].positions
    if field is None:
        return  # relative positions (T5 buckets, DeBERTa): no table to overflow
    if family == "deberta-v2" and not config.position_biased_input:
        return
    positions = int(getattr(config, field))
    # RoBERTa-style models number positions from pad_token_id + 1 (fairseq), so they need
    # pad + 1 extra rows.
    offset = (config.pad_token_id or 0) + 1 if family in PAD_OFFSET_POSITIONS else 0
    if max_length + offset > positions:
        extra = f" (+{offset}: {family} positions start after the pad id)" if offset else ""
        raise ModelConfigError(
            f"examples of {max_length} tokens{extra} do not fit the {family} model's {positions} "
            f"positions; raise model.overrides.{field} to at least {max_length + offset} "
            "or shorten the examples"
        )


def model_config_for(
    cfg: ModelConfig, vocab_size: int, specials: Mapping[str, int | None], max_length: int
) -> tf.PreTrainedConfig:
    """Build the transformers config (no weights): preset, vocab, special ids, then overrides.

    Args:
        cfg: The model section.
        vocab_size: Rows of the embedding; at least the tokenizer's `specials["vocab_size"]`.
        specials: The examples manifest's special ids (cls, eos, mask, pad, sep, sentinel_top,
            vocab_size); a missing key or None means the tokenizer has no such token.
        max_length: Tokens per example (the encoder side for T5 and BART).

    Raises:
        ModelConfigError: unknown or ill-typed override, too small a vocabulary, or examples
            longer than the position table.
    """
    spec = FAMILIES[cfg.family]
    fields: dict[str, Any] = presets.preset(spec.preset, cfg.size) | {"vocab_size": vocab_size}
    if cfg.dropout is not None:
        fields |= dict.fromkeys(spec.dropouts, cfg.dropout)
    fields |= _special_fields(cfg.family, specials)
    _check_overrides(cfg.family, cfg.overrides)
    fields |= cfg.overrides
    try:
        config = spec.config(**fields)
    except (TypeError, ValueError, StrictDataclassError) as err:  # field types, architecture
        raise ModelConfigError(
            f"invalid {spec.config.__name__} for model.family={cfg.family} size={cfg.size} "
            f"with model.overrides={cfg.overrides}: {err}"
        ) from err
    _check_fits(cfg.family, config, specials, max_length)
    pad_vocab(config, cfg.pad_vocab_to_multiple_of)
    config._attn_implementation = spec.attention
    return config


def build_model(
    cfg: ModelConfig,
    objective: str,
    vocab_size: int,
    specials: Mapping[str, int | None],
    max_length: int,
    attention: DocumentAttention = "dense",
    stock: bool = False,
) -> tf.PreTrainedModel:
    """Check the objective, then build a freshly initialised model (the caller seeds torch).

    With `model.implementation` fast the model is the family's fast subclass where it has one
    (training/models/fast/: same parameters, leaner forward); `stock` builds the transformers
    class itself, as an export holds it.

    `attention` flex (`TrainConfig.document_attention`) makes a causal model attend through
    FlexAttention where a batch carries document ids (training/models/attention.py).

    Raises:
        ObjectiveMismatchError: the family cannot train on `objective`.
        ModelConfigError: see `model_config_for`; or flex for a family that is no decoder.
    """
    check_objective(cfg.family, objective)
    config = model_config_for(cfg, vocab_size, specials, max_length)
    if attention == "flex":
        if FAMILIES[cfg.family].kind != "decoder":
            raise ModelConfigError(f"flex attention is for causal families, not {cfg.family}")
        register_document_flex()
        config._attn_implementation = DOCUMENT_FLEX
    cls = model_class(cfg.family)
    if cfg.implementation == "fast" and not stock:
        cls = fast_class(cfg.family) or cls
    model = cls(config)
    if not cfg.bias:  # nanoGPT's bias=False: zero and frozen (training/models/bias.py)
        drop_biases(model)
    if cfg.activation_checkpointing:
        # transformers 5.23 deprecates gradient_checkpointing_enable for this name; it uses
        # torch's non-reentrant checkpoint by default.
        model.activation_checkpointing_enable()
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters, each tied (shared) tensor counted once."""
    return sum(p.numel() for p in model.parameters())  # parameters() skips shared duplicates
