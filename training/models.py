"""Model families and named sizes over `transformers` classes; objective ↔ family checks.

Every model we pretrain is a stock `transformers` class built from a config, so each export
reloads with `from_pretrained` (see `auto_class`). This module maps a family and a named size
to that config, fills in the tokenizer's special ids and checks that the examples fit the model.
It holds no training logic and never imports Ray, DeepSpeed or MLflow; the loss lives in
`training/forward.py`. Sizes and the published-count check are documented in docs/models.md.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import torch
import transformers as tf
from huggingface_hub.errors import StrictDataclassError
from pydantic import BaseModel, ConfigDict, Field

Family = Literal["bert", "roberta", "gpt2", "llama", "t5"]
Size = Literal["tiny", "mini", "small", "base", "large"]
Value = int | float | str | bool

#: The example objectives (`examples.objective`) each family trains on.
OBJECTIVES: dict[str, tuple[str, ...]] = {
    "bert": ("bert", "sop"),  # SOP reuses BERT's binary next-sentence head
    "roberta": ("roberta",),
    "gpt2": ("causal",),
    "llama": ("causal",),
    "t5": ("span_corruption",),
}

#: Attention kernel of every model we build: unlike flash attention, SDPA (like eager) honours
#: the custom 4-D document mask of packed causal blocks (training/packing.py).
ATTENTION = "sdpa"


class ObjectiveMismatchError(ValueError):
    """The model family cannot train on the examples' objective."""


class ModelConfigError(ValueError):
    """The model section (size, overrides) does not fit the tokenizer or the examples."""


class ModelConfig(BaseModel):
    """Which model to pretrain: a family, a named size, and any transformers config field."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    family: Family = Field(
        "bert",
        description="Architecture: bert (MLM + NSP/SOP), roberta (MLM), gpt2 and llama "
        "(causal LM), t5 (span corruption).",
    )
    size: Size = Field(
        "tiny", description="Named shape preset (docs/models.md); tiny is for tests and demos."
    )
    overrides: dict[str, Value] = Field(
        default_factory=dict,
        description="Any field of the transformers config, e.g. {num_hidden_layers: 4}; "
        "wins over the size preset.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass (gradient checkpointing) to "
        "save memory on large models.",
    )
    dropout: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Override every dropout probability of the family (None: the preset's).",
    )


class Shape(NamedTuple):
    """A size preset: layers, model width, attention heads, feed-forward width."""

    layers: int
    hidden: int
    heads: int
    ffn: int


# BERT/RoBERTa tiny, mini, small are the shapes of Turc et al. 2019 ("Well-Read Students");
# base and large are the published BERT/RoBERTa shapes.
_ENCODER = {
    "tiny": Shape(2, 128, 2, 512),
    "mini": Shape(4, 256, 4, 1024),
    "small": Shape(4, 512, 8, 2048),
    "base": Shape(12, 768, 12, 3072),
    "large": Shape(24, 1024, 16, 4096),
}
# base = published GPT-2 "small" (124M), large = published GPT-2 "large" (774M).
_GPT2 = _ENCODER | {"small": Shape(6, 512, 8, 2048), "large": Shape(36, 1280, 20, 5120)}
# SwiGLU width = 8/3 of the model width rounded up to a multiple of 64 (Llama's rule of thumb).
_LLAMA = {
    "tiny": Shape(2, 128, 2, 384),
    "mini": Shape(4, 256, 4, 704),
    "small": Shape(8, 512, 8, 1408),
    "base": Shape(12, 768, 12, 2048),
    "large": Shape(24, 1024, 16, 2752),
}
# small/base/large = published T5 v1.0 (t5-small/base/large); head width d_kv is always 64.
_T5 = _ENCODER | {"small": Shape(6, 512, 8, 2048)}


def _preset(family: Family, size: Size) -> dict[str, Value]:
    """The transformers config fields of a family's named size."""
    if family in ("bert", "roberta"):
        s = _ENCODER[size]
        return {
            "num_hidden_layers": s.layers,
            "hidden_size": s.hidden,
            "num_attention_heads": s.heads,
            "intermediate_size": s.ffn,
            # RoBERTa positions start after the pad id (1): 512 tokens need 514 rows.
            "max_position_embeddings": 512 if family == "bert" else 514,
            "type_vocab_size": 2 if family == "bert" else 1,
            **({"layer_norm_eps": 1e-5} if family == "roberta" else {}),
        }
    if family == "gpt2":
        s = _GPT2[size]
        return {"n_layer": s.layers, "n_embd": s.hidden, "n_head": s.heads, "n_inner": s.ffn}
    if family == "llama":
        s = _LLAMA[size]
        return {
            "num_hidden_layers": s.layers,
            "hidden_size": s.hidden,
            "num_attention_heads": s.heads,
            "num_key_value_heads": s.heads,
            "intermediate_size": s.ffn,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
        }
    s = _T5[size]
    return {
        "num_layers": s.layers,
        "d_model": s.hidden,
        "num_heads": s.heads,
        "d_ff": s.ffn,
        "d_kv": 64,
        "feed_forward_proj": "relu",
    }


_DROPOUTS: dict[Family, tuple[str, ...]] = {
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "roberta": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "llama": ("attention_dropout",),
    "t5": ("dropout_rate",),
}

_CLASSES: dict[Family, tuple[type[tf.PreTrainedConfig], type[tf.PreTrainedModel]]] = {
    "bert": (tf.BertConfig, tf.BertForPreTraining),
    "roberta": (tf.RobertaConfig, tf.RobertaForMaskedLM),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    "t5": (tf.T5Config, tf.T5ForConditionalGeneration),
}

_AUTO: dict[Family, type[Any]] = {
    "bert": tf.AutoModelForPreTraining,
    "roberta": tf.AutoModelForMaskedLM,
    "gpt2": tf.AutoModelForCausalLM,
    "llama": tf.AutoModelForCausalLM,
    "t5": tf.AutoModelForSeq2SeqLM,
}


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


def model_class(family: Family) -> type[tf.PreTrainedModel]:
    """The `transformers` pretraining class of `family` (e.g. `BertForPreTraining`)."""
    return _CLASSES[family][1]


def family_of(config: tf.PreTrainedConfig) -> Family:
    """The family of a config built here (its `model_type`).

    Raises:
        ModelConfigError: the config is of another model type.
    """
    for family, (config_class, _) in _CLASSES.items():
        if type(config) is config_class:  # exact: no subclass of another family
            return family
    raise ModelConfigError(f"{type(config).__name__} is none of the families {list(_CLASSES)}")


def auto_class(family: Family) -> type[Any]:
    """The `AutoModelFor...` class that reloads an export of `family` with `from_pretrained`."""
    return _AUTO[family]


def _special_fields(family: Family, specials: Mapping[str, int | None]) -> dict[str, int | None]:
    """Config fields for the tokenizer's special ids (never transformers' hub defaults)."""
    pad, eos = specials.get("pad"), specials.get("eos")
    if family == "bert":
        return {"pad_token_id": pad}
    if family == "roberta":
        return {"pad_token_id": pad, "bos_token_id": specials.get("cls"), "eos_token_id": eos}
    if family in ("gpt2", "llama"):  # causal blocks hold only eos (as document separator)
        return {"pad_token_id": pad, "bos_token_id": eos, "eos_token_id": eos}
    return {"pad_token_id": pad, "eos_token_id": eos, "decoder_start_token_id": pad}


def _check_overrides(family: Family, overrides: Mapping[str, Value]) -> None:
    """Refuse override keys that are not fields of the family's transformers config."""
    config_class = _CLASSES[family][0]
    # transformers 5 configs are strict dataclasses but silently keep unknown kwargs as
    # attributes, so a misspelled key would otherwise be ignored by the model.
    known = {field.name for field in dataclasses.fields(config_class)}
    known |= {"decoder_start_token_id", *config_class.attribute_map}  # aliases: GPT-2 hidden_size
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
    if family == "t5":
        return  # relative position buckets: no position table to overflow
    field = "n_positions" if family == "gpt2" else "max_position_embeddings"
    positions = int(getattr(config, field))
    # RoBERTa numbers positions from pad_token_id + 1 (fairseq), so it needs pad + 1 extra rows.
    offset = (config.pad_token_id or 0) + 1 if family == "roberta" else 0
    if max_length + offset > positions:
        extra = f" (+{offset}: roberta positions start after the pad id)" if offset else ""
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
        max_length: Tokens per example (the encoder side for T5).

    Raises:
        ModelConfigError: unknown or ill-typed override, too small a vocabulary, or examples
            longer than the position table.
    """
    config_class = _CLASSES[cfg.family][0]
    fields: dict[str, Any] = _preset(cfg.family, cfg.size) | {"vocab_size": vocab_size}
    if cfg.dropout is not None:
        fields |= dict.fromkeys(_DROPOUTS[cfg.family], cfg.dropout)
    fields |= _special_fields(cfg.family, specials)
    _check_overrides(cfg.family, cfg.overrides)
    fields |= cfg.overrides
    try:
        config = config_class(**fields)
    except (TypeError, ValueError, StrictDataclassError) as err:  # field types, architecture
        raise ModelConfigError(
            f"invalid {config_class.__name__} for model.family={cfg.family} size={cfg.size} "
            f"with model.overrides={cfg.overrides}: {err}"
        ) from err
    _check_fits(cfg.family, config, specials, max_length)
    config._attn_implementation = ATTENTION
    return config


def build_model(
    cfg: ModelConfig,
    objective: str,
    vocab_size: int,
    specials: Mapping[str, int | None],
    max_length: int,
) -> tf.PreTrainedModel:
    """Check the objective, then build a freshly initialised model (the caller seeds torch).

    Raises:
        ObjectiveMismatchError: the family cannot train on `objective`.
        ModelConfigError: see `model_config_for`.
    """
    check_objective(cfg.family, objective)
    config = model_config_for(cfg, vocab_size, specials, max_length)
    model = model_class(cfg.family)(config)
    if cfg.activation_checkpointing:
        # transformers 5.23 deprecates gradient_checkpointing_enable for this name; it uses
        # torch's non-reentrant checkpoint by default.
        model.activation_checkpointing_enable()
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters, each tied (shared) tensor counted once."""
    return sum(p.numel() for p in model.parameters())  # parameters() skips shared duplicates
