"""Training FLOPs per token of every family, for MFU (docs/models.md, "FLOPs per token").

Counted on a meta-device build of the real `transformers` class (no memory, no weights), so the
parameter counts are exact; the attention term follows each family's attention pattern.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import transformers as tf
from torch import Tensor, nn

from training.models.models import MLM_OBJECTIVES, SEQ2SEQ_OBJECTIVES, family_of, model_class
from training.models.vocab import UNPADDED_VOCAB

#: The vocabulary projection of each family (tied to the input embedding except for llama).
_OUTPUT_LAYER = {
    "bert": "cls.predictions.decoder",
    "roberta": "lm_head.decoder",
    "gpt2": "lm_head",
    "llama": "lm_head",
    "t5": "lm_head",
    "albert": "predictions.decoder",
    "distilbert": "vocab_projector",
    "electra": "discriminator_predictions.dense_prediction",
    "deberta-v2": "cls.predictions.decoder",
    "bart": "lm_head",
    "mistral": "lm_head",
    "mixtral": "lm_head",
    "xlm-roberta": "lm_head.decoder",
    "longformer": "lm_head.decoder",
    "big_bird": "cls.predictions.decoder",
}


@dataclass(frozen=True)
class CompanionModels:
    """The models a training step runs beside the one it trains, each counted in its FLOPs.

    Attributes:
        generator: ELECTRA's generator (a masked LM, trained with the discriminator).
        teacher: A distillation teacher (forward passes only).
    """

    generator: tf.PreTrainedConfig | None = None
    teacher: tf.PreTrainedConfig | None = None


def _body_parameters(module: nn.Module, output: Tensor) -> int:
    """Parameters of `module` except embedding tables and the vocabulary projection."""
    skip = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    skip.add(id(output))
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)


def flops_per_token(
    model_config: tf.PreTrainedConfig,
    seq_len: int,
    objective: str,
    *,
    mlm_probability: float = 0.15,
    sparse_mlm: bool = True,
    target_len: int | None = None,
    companions: CompanionModels = CompanionModels(),
) -> float:
    """Training FLOPs (forward + backward) per input token, for MFU (docs/models.md).

    PaLM appendix B / Megatron convention: 6·N + 12·L·A·C, where N counts the non-embedding
    parameters a token passes through, L layers, A = heads * head width and C the tokens each
    one attends to: `seq_len`, or less for local attention (Mistral's sliding window,
    Longformer's window, BigBird's blocks), the causal mask not halving it. N counts ALBERT's
    shared layers once per use and a mixture of experts' experts at top-k / experts. The
    vocabulary projection (6·d·V per predicted token) is counted apart: at `mlm_probability` of
    the positions for sparse MLM, at all of them otherwise, and over the real vocabulary only
    (not the rows `model.pad_vocab_to_multiple_of` adds). Seq2seq (T5, BART) counts per
    encoder token: the decoder runs `target_len / seq_len` tokens per encoder token, with
    self-attention over `target_len` and cross-attention over `seq_len`. The `companions` add
    theirs: ELECTRA's generator (sparse MLM), a distillation teacher's forward pass (a third of
    its training FLOPs).

    Raises:
        ValueError: a seq2seq objective without `target_len`.
    """
    family = family_of(model_config)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = model_class(family)(copy.deepcopy(model_config))
    projection = model.get_submodule(_OUTPUT_LAYER[family])
    assert isinstance(projection, nn.Linear)
    output = projection.weight  # (V, d)
    if objective in SEQ2SEQ_OBJECTIVES:
        if target_len is None:
            raise ValueError(f"flops_per_token for {objective} needs target_len")
        return _seq2seq_flops(model, model_config, output, seq_len, target_len)
    predicted = mlm_probability if objective in MLM_OBJECTIVES and sparse_mlm else 1.0
    if family == "electra":
        predicted = 1.0  # the discriminator labels every token
    context = _attended(model_config, seq_len)
    attention = 12.0 * int(model_config.num_hidden_layers) * _width(model_config) * context
    body = 6.0 * _compute_parameters(model, output) + attention
    extra = _companion_flops(companions, seq_len, mlm_probability, sparse_mlm)
    return body + _head_flops(model_config, output) * predicted + extra


def _head_flops(config: tf.PreTrainedConfig, output: Tensor) -> float:
    """FLOPs of the vocabulary projection per predicted token, over the real vocabulary only."""
    rows = getattr(config, UNPADDED_VOCAB, None) or output.shape[0]
    return 6.0 * rows * output.shape[1]  # padded rows are not useful work


def _width(config: tf.PreTrainedConfig) -> float:
    """A = heads * head width: the attention term's width."""
    return float(config.num_attention_heads * _head_dim(config))


def _companion_flops(
    companions: CompanionModels, seq_len: int, mlm_probability: float, sparse_mlm: bool
) -> float:
    """ELECTRA's generator (sparse MLM) and a distillation teacher's forward pass, per token."""
    generator, teacher = companions.generator, companions.teacher
    extra = 0.0
    if generator is not None:
        extra += flops_per_token(
            generator, seq_len, "roberta", mlm_probability=mlm_probability, sparse_mlm=True
        )
    if teacher is not None:
        teacher_mlm = flops_per_token(
            teacher, seq_len, "roberta", mlm_probability=mlm_probability, sparse_mlm=sparse_mlm
        )
        extra += teacher_mlm / 3.0  # forward only: a third of its training FLOPs
    return extra


def _seq2seq_flops(
    model: nn.Module,
    config: tf.PreTrainedConfig,
    output: Tensor,
    seq_len: int,
    target_len: int,
) -> float:
    """Encoder-decoder FLOPs per encoder token: the decoder runs `target_len / seq_len` tokens.

    The decoder's self-attention spans `target_len`, its cross-attention `seq_len`.
    """
    family = family_of(config)
    prefix = "model." if family == "bart" else ""
    layers = (
        (int(config.num_layers), int(config.num_decoder_layers))
        if family == "t5"
        else (int(config.encoder_layers), int(config.decoder_layers))
    )
    width = _width(config)
    encoder = 6.0 * _body_parameters(model.get_submodule(f"{prefix}encoder"), output)
    encoder += 12.0 * layers[0] * width * seq_len
    decoder = 6.0 * _body_parameters(model.get_submodule(f"{prefix}decoder"), output)
    decoder += _head_flops(config, output)
    decoder += 12.0 * layers[1] * width * (target_len + seq_len)
    return encoder + decoder * target_len / seq_len


def _compute_parameters(model: nn.Module, output: Tensor) -> float:
    """Non-embedding parameters one token passes through (ALBERT reuse, MoE top-k)."""
    total = float(_body_parameters(model, output))
    config = model.config
    if isinstance(config, tf.AlbertConfig):  # each layer group runs L / G times
        groups = model.get_submodule("albert.encoder.albert_layer_groups")
        shared = sum(p.numel() for p in groups.parameters())
        total += shared * (config.num_hidden_layers / config.num_hidden_groups - 1)
    if isinstance(config, tf.MixtralConfig):  # a token runs top-k of the experts
        experts = sum(
            p.numel()
            for name, module in model.named_modules()
            if name.endswith("mlp.experts")
            for p in module.parameters()
        )
        total -= experts * (1 - config.num_experts_per_tok / config.num_local_experts)
    return total


def _attended(config: tf.PreTrainedConfig, seq_len: int) -> int:
    """Tokens one query attends to: `seq_len`, or the local window of sparse attention."""
    if isinstance(config, tf.LongformerConfig):
        windows = config.attention_window
        window = max(windows) if isinstance(windows, list) else int(windows)
        return min(seq_len, window + 1)
    if isinstance(config, tf.BigBirdConfig) and config.attention_type == "block_sparse":
        # 3 sliding + 2 global + r random blocks, once the sequence is long enough to be sparse
        blocks = 5 + int(config.num_random_blocks)
        if seq_len > (blocks + 2 + int(config.num_random_blocks)) * int(config.block_size):
            return blocks * int(config.block_size)
        return seq_len
    sliding = getattr(config, "sliding_window", None)  # Mistral, Mixtral
    if isinstance(sliding, int) and sliding > 0:
        return min(seq_len, sliding)
    return seq_len


def _head_dim(config: tf.PreTrainedConfig) -> int:
    """Width of one attention head (T5 `d_kv`, Llama `head_dim`, else hidden / heads)."""
    explicit = getattr(config, "head_dim", None)  # T5 maps head_dim to d_kv
    if explicit:
        return int(explicit)
    return int(config.hidden_size // config.num_attention_heads)
