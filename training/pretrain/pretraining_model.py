"""Build what a pretraining run trains: a `transformers` model, or ELECTRA's or distillation's pair.

Most families train their exported model directly. ELECTRA trains a generator beside the
discriminator (training/models/electra.py); DistilBERT with a teacher trains a student beside a
frozen teacher (training/models/distill.py). `training.pretrain.losses.exported_model` picks the
part that is saved as the Hugging Face export. Mixtral under ZeRO-3 has its expert blocks registered
as ZeRO-3 leaf modules (`zero3_leaf_modules`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import transformers as tf
from torch import nn

from training.models.distill import build_distillation, check_tokenizer, student_config
from training.models.electra import ElectraPretrainer, generator_config
from training.models.models import build_model, check_objective
from training.pretrain.config import TrainConfig


class PretrainingModelError(ValueError):
    """The train section asks for something this family cannot do."""


def build_pretraining_model(
    cfg: TrainConfig,
    objective: str,
    vocab_size: int,
    specials: Mapping[str, int | None],
    max_length: int,
    teacher_dir: Path | None = None,
    tokenizer_dir: Path | None = None,
) -> nn.Module:
    """The module a run trains, freshly initialised (the caller seeds torch).

    Args:
        cfg: The train section.
        objective: The examples' objective.
        vocab_size: Embedding rows.
        specials: The examples manifest's special ids.
        max_length: Tokens per example.
        teacher_dir: The resolved local teacher directory when `cfg.distillation` is set.
        tokenizer_dir: The examples' tokenizer; the teacher's must be the same.

    Raises:
        ObjectiveMismatchError, ModelConfigError: see `training.models.models.build_model`.
        PretrainingModelError: distillation without a resolved teacher.
        DistillationError: a teacher that cannot teach this tokenizer.
    """
    family = cfg.model.family
    if cfg.distillation is not None:
        check_objective(family, objective)
        if teacher_dir is None:
            raise PretrainingModelError("train.distillation needs its teacher resolved first")
        if tokenizer_dir is not None:
            check_tokenizer(teacher_dir, tokenizer_dir)
        distilled = build_distillation(teacher_dir, cfg.distillation, vocab_size, cfg.model.dropout)
        if cfg.model.activation_checkpointing:
            distilled.student.activation_checkpointing_enable()
        return distilled
    attention = cfg.document_attention()
    base = build_model(cfg.model, objective, vocab_size, specials, max_length, attention)
    if family != "electra":
        return base
    assert isinstance(base, tf.ElectraForPreTraining)
    gen = generator_config(base.config, cfg.model.size, cfg.electra)
    model = ElectraPretrainer(base, gen, cfg.electra)
    if cfg.model.activation_checkpointing:  # build_model did the discriminator's
        model.generator.activation_checkpointing_enable()
    return model


def zero3_leaf_modules(model: nn.Module) -> list[type[nn.Module]]:
    """Module classes ZeRO-3 must gather whole: a mixture of experts' sparse blocks.

    A token batch reaches only some experts, so ranks would gather different parameters and
    hang in the collective; as a leaf, the whole block is gathered on every rank.
    """
    leaves: list[type[nn.Module]] = [tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock]
    return [cls for cls in leaves if any(isinstance(m, cls) for m in model.modules())]


def build_export_model(
    cfg: TrainConfig,
    objective: str,
    vocab_size: int,
    specials: Mapping[str, int | None],
    max_length: int,
    teacher_dir: Path | None = None,
) -> tuple[tf.PreTrainedModel, str]:
    """The exported model of a run, freshly built, and its key prefix in the run's weights.

    ELECTRA exports its discriminator (`discriminator.`), distillation its student
    (`student.`; the teacher's config.json gives the student's shape, no teacher weights are
    read); every other family the model itself (no prefix).
    """
    if cfg.distillation is not None:
        if teacher_dir is None:
            raise PretrainingModelError("exporting a distilled student needs its teacher's config")
        teacher = tf.BertConfig.from_pretrained(teacher_dir, local_files_only=True)
        layers = cfg.distillation.student_layers or max(1, teacher.num_hidden_layers // 2)
        config = student_config(teacher, layers, cfg.model.dropout)
        return tf.DistilBertForMaskedLM(config), "student."
    model = build_model(cfg.model, objective, vocab_size, specials, max_length, stock=True)
    return model, "discriminator." if cfg.model.family == "electra" else ""
