"""ELECTRA pretraining: a small MLM generator and a replaced-token-detection discriminator.

`ElectraPretrainer` holds both `transformers` models with one shared embedding module (word,
position and type embeddings and their LayerNorm), as in Clark et al. 2020. The generator fills
the masked positions by sampling from its own MLM distribution; the discriminator labels every
real token as original or replaced. Only the discriminator is exported (`ElectraForPreTraining`);
the generator is a training device. The loss itself is in training/pretrain/losses/encoder.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from torch import Tensor, nn

from training.models import presets
from training.models.config import ElectraConfig as ElectraConfig
from training.models.vocab import UNPADDED_VOCAB

IGNORE_INDEX = -100


class ElectraPretrainer(nn.Module):
    """Generator (`ElectraForMaskedLM`) and discriminator (`ElectraForPreTraining`).

    The two share one embedding module.
    `config` is the discriminator's, so code that reads `model.config` (FLOPs, the family, the
    reference loss) sees the model that gets exported.
    """

    def __init__(
        self,
        discriminator: tf.ElectraForPreTraining,
        generator_config: tf.ElectraConfig,
        cfg: ElectraConfig | None = None,
    ):
        """Build the generator around the discriminator's embeddings."""
        super().__init__()
        cfg = cfg or ElectraConfig()
        self.rtd_weight, self.temperature = cfg.rtd_weight, cfg.temperature
        disc_config = discriminator.config
        if generator_config.embedding_size != disc_config.embedding_size:
            raise ValueError(
                f"generator embedding_size {generator_config.embedding_size} must equal the "
                f"discriminator's {disc_config.embedding_size}: ELECTRA shares the embeddings"
            )
        self.discriminator = discriminator
        self.generator = tf.ElectraForMaskedLM(generator_config)
        # One module, two owners: parameters() yields it once, so it is trained (and saved by
        # DeepSpeed) once; the generator's output layer is tied to the shared word embedding.
        self.generator.electra.embeddings = discriminator.electra.embeddings
        self.generator.generator_lm_head.weight = (
            discriminator.electra.embeddings.word_embeddings.weight
        )
        self.config = disc_config

    def forward(self, **batch: Tensor) -> Tensor:  # pragma: no cover - losses call the parts
        """Not used: training/pretrain/losses/encoder.py steps generator and discriminator."""
        raise NotImplementedError("use training.pretrain.losses.pretraining_loss")


def generator_config(
    disc_config: tf.ElectraConfig, size: str, cfg: ElectraConfig
) -> tf.ElectraConfig:
    """The generator's config: its preset, the discriminator's vocabulary, ids and embeddings."""
    fields: dict[str, Any] = presets.electra_generator(cfg.generator_size or size)
    fields |= cfg.generator_overrides
    shared = (
        "vocab_size",
        "embedding_size",
        "max_position_embeddings",
        "type_vocab_size",
        "pad_token_id",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
    )
    fields |= {name: getattr(disc_config, name) for name in shared}
    if hasattr(disc_config, UNPADDED_VOCAB):  # the generator predicts over the same rows
        fields[UNPADDED_VOCAB] = getattr(disc_config, UNPADDED_VOCAB)
    config = tf.ElectraConfig(**fields)
    config._attn_implementation = disc_config._attn_implementation
    return config


@dataclass(frozen=True)
class Corruption:
    """The discriminator's input and labels made from one generator pass.

    Attributes:
        input_ids: (B, T) the original ids with every masked position replaced by a sample.
        labels: (B, T) float: 1.0 where `input_ids` differs from the original token, else 0.0.
            A sample that happens to equal the original counts as original (Clark et al.).
        original: (B, T) the uncorrupted ids (masked positions restored from the MLM labels).
    """

    input_ids: Tensor
    labels: Tensor
    original: Tensor


def corrupt(
    input_ids: Tensor,
    mlm_labels: Tensor,
    generator_logits: Tensor,
    temperature: float = 1.0,
    rng: torch.Generator | None = None,
) -> Corruption:
    """Replace the masked positions by samples from the generator; label what changed.

    Args:
        input_ids: (B, T) masked ids (the generator's input).
        mlm_labels: (B, T) original id at masked positions, -100 elsewhere.
        generator_logits: (M, V) logits at the M masked positions, in row-major order of
            `mlm_labels != -100`.
        temperature: Divides the logits before sampling.
        rng: Generator of the Gumbel noise (a fixed one makes evaluation repeatable).
    """
    selected = mlm_labels != IGNORE_INDEX  # (B, T)
    original = torch.where(selected, mlm_labels, input_ids)
    with torch.no_grad():
        logits = generator_logits.float() / temperature
        # Gumbel-max: argmax(logits + Gumbel noise) is a sample of softmax(logits).
        uniform = torch.rand(logits.shape, generator=rng, device=logits.device)
        noise = -torch.log(-torch.log(uniform.clamp(1e-9, 1.0 - 1e-9)))
        sampled = (logits + noise).argmax(dim=-1)  # (M,)
    corrupted = original.clone()
    corrupted[selected] = sampled.to(corrupted.dtype)
    labels = (corrupted != original).float()
    return Corruption(corrupted, labels, original)
