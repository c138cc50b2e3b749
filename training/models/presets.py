"""Named size presets of every model family, and the published models they reproduce.

`preset(family, size)` gives the `transformers` config fields (of the family's config class) of
a named size; `training/models/models.py` adds the vocabulary and special ids, builds the config and
the model. This module holds numbers and field names only: it imports no model code, and it
does not know the pretraining class or the objective of a family (models.py does).
`PUBLISHED` maps published checkpoints to a preset plus overrides and their parameter count,
checked in tests/training/models/test_presets.py. Tables: docs/model_sizes.md.

`base` and `large` (and `small` where one is published) are published shapes; `tiny` and
`mini` are scaled-down rungs for tests and demos, small enough to run on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

Value = int | float | str | bool
Fields = dict[str, Value]

SIZES = ("tiny", "mini", "small", "base", "large")


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

# DistilBERT students keep every second layer of the BERT preset of the same size (at least 2):
# base is the published distilbert-base (6 layers of BERT-base); large halves BERT-large.
_DISTILBERT = {size: s._replace(layers=max(2, s.layers // 2)) for size, s in _ENCODER.items()}
# small = published ELECTRA-Small discriminator (12 layers of width 256); base/large = BERT's.
_ELECTRA = _ENCODER | {"small": Shape(12, 256, 4, 1024)}
# Token embedding width (ALBERT, ELECTRA); where narrower than the model it is projected up.
_ALBERT_EMBEDDING = {"tiny": 64, "mini": 128, "small": 128, "base": 128, "large": 128}
_ELECTRA_EMBEDDING = {"tiny": 64, "mini": 128, "small": 128, "base": 768, "large": 1024}
# ELECTRA generators (Clark et al. 2020, Table 6; google-research/electra README): the released
# small uses a generator as large as its discriminator, base 1/3 and large 1/4 of the width, heads
# and FFN; tiny and mini take the paper's default 1/4. The token embedding is shared with the
# discriminator, so it keeps the discriminator's embedding width.
_ELECTRA_GENERATOR = {
    "tiny": Shape(2, 32, 1, 128),
    "mini": Shape(4, 64, 1, 256),
    "small": Shape(12, 256, 4, 1024),
    "base": Shape(12, 256, 4, 1024),
    "large": Shape(24, 256, 4, 1024),
}
# small = published deberta-v3-small (6 layers of width 768); base/large = deberta-v3-base/large.
_DEBERTA = _ENCODER | {"small": Shape(6, 768, 12, 3072)}
# Layers per stack (encoder = decoder); base/large = published bart-base/bart-large.
_BART = _ENCODER | {"base": Shape(6, 768, 12, 3072), "large": Shape(12, 1024, 16, 4096)}
# Our rungs (no published Mistral below 7B): Llama's widths, Mistral-7B's FFN ratio of 3.5
# (14336 / 4096) and grouped-query attention with a quarter as many key/value heads (at least 1).
_MISTRAL = {
    "tiny": Shape(2, 128, 2, 448),
    "mini": Shape(4, 256, 4, 896),
    "small": Shape(8, 512, 8, 1792),
    "base": Shape(12, 768, 12, 2688),
    "large": Shape(24, 1024, 16, 3584),
}
# Mistral-7B attends over a window half its 8,192-token training context; tiny's 16 tokens make
# the window bite on test-length sequences.
_SLIDING_WINDOW = {"tiny": 16, "mini": 64, "small": 256, "base": 1024, "large": 2048}
_EXPERTS = {"tiny": 4, "mini": 8, "small": 8, "base": 8, "large": 8}  # Mixtral: 8, top 2
# Longformer: the window is even and each sequence is padded to a multiple of it. Positions
# count the RoBERTa offset (pad id 1 + 1): 4,098 rows hold 4,096 tokens.
_LONGFORMER_WINDOW = {"tiny": 16, "mini": 32, "small": 64, "base": 512, "large": 512}
_LONGFORMER_POSITIONS = {"tiny": 1026, "mini": 2050, "small": 4098, "base": 4098, "large": 4098}
# BigBird: block-sparse attention needs more than (5 + 2 * num_random_blocks) * block_size
# tokens (88 for tiny, 704 for base); shorter sequences fall back to full attention.
_BIGBIRD_BLOCK = {"tiny": 8, "mini": 16, "small": 32, "base": 64, "large": 64}
_BIGBIRD_POSITIONS = {"tiny": 1024, "mini": 2048, "small": 4096, "base": 4096, "large": 4096}


def _encoder_fields(s: Shape) -> Fields:
    """The BERT-style shape fields shared by every encoder config."""
    return {
        "num_hidden_layers": s.layers,
        "hidden_size": s.hidden,
        "num_attention_heads": s.heads,
        "intermediate_size": s.ffn,
    }


def _bert(size: str) -> Fields:
    return _encoder_fields(_ENCODER[size]) | {"max_position_embeddings": 512, "type_vocab_size": 2}


def _roberta(size: str) -> Fields:
    """RoBERTa, also XLM-R: RoBERTa's shapes, one token type, positions offset by the pad id."""
    # RoBERTa positions start after the pad id (1): 512 tokens need 514 rows.
    fields = {"max_position_embeddings": 514, "type_vocab_size": 1, "layer_norm_eps": 1e-5}
    return _encoder_fields(_ENCODER[size]) | fields


#: GPT-2's and ALBERT's GELU, the tanh approximation, as PyTorch's one fused kernel: transformers'
#: default for them (`gelu_new`) spells it out as seven tensor operations, each with its own
#: backward. Same function (within float rounding), same stock config class; a GPT-2 step at
#: nanoGPT's CPU shapes took 52.8 ms with `gelu_new` and 40.9 ms with this
#: (docs/benchmarks.md, "The module").
TANH_GELU = "gelu_pytorch_tanh"


def _gpt2(size: str) -> Fields:
    s = _GPT2[size]
    shape: Fields = {"n_layer": s.layers, "n_embd": s.hidden, "n_head": s.heads, "n_inner": s.ffn}
    return shape | {"activation_function": TANH_GELU}


def _llama(size: str) -> Fields:
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


def _t5(size: str) -> Fields:
    s = _T5[size]
    return {
        "num_layers": s.layers,
        "d_model": s.hidden,
        "num_heads": s.heads,
        "d_ff": s.ffn,
        "d_kv": 64,
        "feed_forward_proj": "relu",
    }


def _albert(size: str) -> Fields:
    # One group of one layer: every layer shares the same weights (ALBERT's default).
    shared = {"num_hidden_groups": 1, "inner_group_num": 1}
    return _bert(size) | {
        "embedding_size": _ALBERT_EMBEDDING[size],
        **shared,
        "hidden_act": TANH_GELU,
    }


def _distilbert(size: str) -> Fields:
    s = _DISTILBERT[size]
    return {
        "n_layers": s.layers,
        "dim": s.hidden,
        "n_heads": s.heads,
        "hidden_dim": s.ffn,
        "max_position_embeddings": 512,
    }


def _electra(size: str) -> Fields:
    """The ELECTRA discriminator (the model we keep)."""
    fields = {"embedding_size": _ELECTRA_EMBEDDING[size], "max_position_embeddings": 512}
    return _encoder_fields(_ELECTRA[size]) | fields | {"type_vocab_size": 2}


def _deberta(size: str) -> Fields:
    """DeBERTa-v3 (`DebertaV2Config`): disentangled relative attention, no absolute positions."""
    return _encoder_fields(_DEBERTA[size]) | {
        "max_position_embeddings": 512,
        "type_vocab_size": 0,
        "relative_attention": True,
        "position_biased_input": False,
        "max_relative_positions": -1,
        # Not dataclass fields of DebertaV2Config: kept as attributes, read by the model.
        "position_buckets": 256,
        "norm_rel_ebd": "layer_norm",
        "share_att_key": True,
        "pos_att_type": "p2c|c2p",  # the config splits it into ["p2c", "c2p"]
        "layer_norm_eps": 1e-7,
    }


def _bart(size: str) -> Fields:
    s = _BART[size]
    return {
        "encoder_layers": s.layers,
        "decoder_layers": s.layers,
        "d_model": s.hidden,
        "encoder_attention_heads": s.heads,
        "decoder_attention_heads": s.heads,
        "encoder_ffn_dim": s.ffn,
        "decoder_ffn_dim": s.ffn,
        "max_position_embeddings": 1024,  # BART adds 2 rows of offset itself
    }


def _mistral_shape(size: str) -> Fields:
    s = _MISTRAL[size]
    return {
        "num_hidden_layers": s.layers,
        "hidden_size": s.hidden,
        "num_attention_heads": s.heads,
        "num_key_value_heads": max(1, s.heads // 4),
        "intermediate_size": s.ffn,
        "max_position_embeddings": 4096,  # RoPE: the trained context, no weights
        "rms_norm_eps": 1e-5,
    }


def _mistral(size: str) -> Fields:
    return _mistral_shape(size) | {"sliding_window": _SLIDING_WINDOW[size]}


def _mixtral(size: str) -> Fields:
    """Mixtral: Mistral's shape with a routed mixture of SwiGLU experts (top 2), full attention."""
    return _mistral_shape(size) | {"num_local_experts": _EXPERTS[size], "num_experts_per_tok": 2}


def _longformer(size: str) -> Fields:
    fields = {
        "max_position_embeddings": _LONGFORMER_POSITIONS[size],
        "attention_window": _LONGFORMER_WINDOW[size],
    }
    return _roberta(size) | fields


def _bigbird(size: str) -> Fields:
    return _bert(size) | {
        "max_position_embeddings": _BIGBIRD_POSITIONS[size],
        "attention_type": "block_sparse",
        "block_size": _BIGBIRD_BLOCK[size],
        "num_random_blocks": 3,
    }


_PRESETS: dict[str, Callable[[str], Fields]] = {
    "bert": _bert,
    "roberta": _roberta,
    "gpt2": _gpt2,
    "llama": _llama,
    "t5": _t5,
    "albert": _albert,
    "distilbert": _distilbert,
    "electra": _electra,
    "deberta": _deberta,
    "bart": _bart,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "xlmr": _roberta,
    "longformer": _longformer,
    "bigbird": _bigbird,
}
FAMILIES = tuple(_PRESETS)


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")


def preset(family: str, size: str) -> Fields:
    """Return the transformers config fields of `family`'s named `size` (no vocab, no ids).

    Raises:
        ValueError: unknown family or size.
    """
    if family not in _PRESETS:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    _check_size(size)
    return _PRESETS[family](size)


def electra_generator(size: str) -> Fields:
    """Return the `ElectraConfig` fields of the generator trained beside the `size` discriminator.

    Raises:
        ValueError: unknown size.
    """
    _check_size(size)
    return _encoder_fields(_ELECTRA_GENERATOR[size]) | {
        "embedding_size": _ELECTRA_EMBEDDING[size],  # tied to the discriminator's embedding
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
    }


class Published(NamedTuple):
    """A published checkpoint as one of our presets plus overrides, and its parameter count."""

    family: str
    size: str
    overrides: Fields
    vocab_size: int
    model_class: str  # the transformers class whose parameters `parameters` counts
    parameters: int  # tied tensors counted once
    source: str

    def fields(self) -> Fields:
        """Return the config fields: the preset, then the overrides, then the vocabulary."""
        return preset(self.family, self.size) | self.overrides | {"vocab_size": self.vocab_size}


_LLAMA2_7B: Fields = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
}
_MISTRAL_7B: Fields = _LLAMA2_7B | {
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
}

_DEBERTA_CLS = "DebertaV2ForSequenceClassification"

#: Published checkpoints (hub name → preset + overrides), each count exact.
PUBLISHED: dict[str, Published] = {
    "bert-base-uncased": Published(
        "bert", "base", {}, 30522, "BertModel", 109_482_240, "BERT-base (with pooler)"
    ),
    "bert-large-uncased": Published(
        "bert", "large", {}, 30522, "BertModel", 335_141_888, "BERT-large (with pooler)"
    ),
    "roberta-base": Published(
        "roberta", "base", {}, 50265, "RobertaModel", 124_645_632, "RoBERTa-base (with pooler)"
    ),
    "roberta-large": Published(
        "roberta", "large", {}, 50265, "RobertaModel", 355_359_744, "RoBERTa-large (with pooler)"
    ),
    "gpt2": Published("gpt2", "base", {}, 50257, "GPT2LMHeadModel", 124_439_808, "GPT-2 124M"),
    "gpt2-large": Published(
        "gpt2", "large", {}, 50257, "GPT2LMHeadModel", 774_030_080, "GPT-2 large 774M"
    ),
    "t5-small": Published(
        "t5", "small", {}, 32128, "T5ForConditionalGeneration", 60_506_624, "T5 v1.0 small"
    ),
    "t5-base": Published(
        "t5", "base", {}, 32128, "T5ForConditionalGeneration", 222_903_552, "T5 v1.0 base"
    ),
    "t5-large": Published(
        "t5", "large", {}, 32128, "T5ForConditionalGeneration", 737_668_096, "T5 v1.0 large"
    ),
    "albert-base-v2": Published(
        "albert", "base", {}, 30000, "AlbertModel", 11_683_584, "ALBERT-base (12M)"
    ),
    "albert-large-v2": Published(
        "albert", "large", {}, 30000, "AlbertModel", 17_683_968, "ALBERT-large (18M)"
    ),
    "distilbert-base-uncased": Published(
        "distilbert", "base", {}, 30522, "DistilBertModel", 66_362_880, "DistilBERT (66M)"
    ),
    "google/electra-small-discriminator": Published(
        "electra", "small", {}, 30522, "ElectraModel", 13_483_008, "ELECTRA-Small (14M)"
    ),
    "facebook/bart-base": Published(
        "bart", "base", {}, 50265, "BartModel", 139_420_416, "BART-base (140M)"
    ),
    "facebook/bart-large": Published(
        "bart", "large", {}, 50265, "BartModel", 406_291_456, "BART-large (400M)"
    ),
    # KerasNLP's DeBERTa-v3 counts include a pooler and a 2-way classifier: the HF class with
    # its default 2 labels has exactly those modules.
    "microsoft/deberta-v3-small": Published(
        "deberta", "small", {}, 128100, _DEBERTA_CLS, 141_896_450, "DeBERTa-v3 small (KerasNLP)"
    ),
    "microsoft/deberta-v3-base": Published(
        "deberta", "base", {}, 128100, _DEBERTA_CLS, 184_423_682, "DeBERTa-v3 base (KerasNLP)"
    ),
    "microsoft/deberta-v3-large": Published(
        "deberta", "large", {}, 128100, _DEBERTA_CLS, 435_063_810, "DeBERTa-v3 large (KerasNLP)"
    ),
    "xlm-roberta-base": Published(
        "xlmr", "base", {}, 250002, "XLMRobertaModel", 278_043_648, "XLM-R base (with pooler)"
    ),
    "xlm-roberta-large": Published(
        "xlmr", "large", {}, 250002, "XLMRobertaModel", 559_890_432, "XLM-R large (with pooler)"
    ),
    "meta-llama/Llama-2-7b-hf": Published(
        "llama", "large", _LLAMA2_7B, 32000, "LlamaForCausalLM", 6_738_415_616, "Llama 2 7B"
    ),
    "mistralai/Mistral-7B-v0.1": Published(
        "mistral",
        "large",
        _MISTRAL_7B | {"sliding_window": 4096},
        32000,
        "MistralForCausalLM",
        7_241_732_096,
        "Mistral 7B v0.1",
    ),
    "mistralai/Mixtral-8x7B-v0.1": Published(
        "mixtral",
        "large",
        _MISTRAL_7B | {"rope_theta": 1e6},
        32000,
        "MixtralForCausalLM",
        46_702_792_704,
        "Mixtral 8x7B v0.1 (all 8 experts; 12.9B active per token)",
    ),
}
