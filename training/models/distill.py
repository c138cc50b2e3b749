"""DistilBERT-style knowledge distillation: a half-depth student learns from a BERT teacher.

The teacher is a local Hugging Face BERT directory (an lmpipe export or any BERT with a masked
LM head, safetensors only) or a registered model version. The student is a `DistilBertForMaskedLM`
of the teacher's width with half its layers, initialised from every other teacher layer
(Sanh et al. 2019). The loss (training/pretrain/losses/encoder.py) is `alpha_kd` ·
KL(teacher ‖ student) at temperature T, scaled by T², over the masked positions, plus
`alpha_mlm` · the student's MLM loss, plus `alpha_cos` · (1 - cosine) between the last hidden
states of every real token.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import transformers as tf
from torch import nn

from training.models.config import DistillConfig as DistillConfig
from training.models.export import require_safetensors

log = logging.getLogger(__name__)


class DistillationError(ValueError):
    """The teacher cannot teach this student: wrong family, vocabulary or tokenizer."""


class DistillationModel(nn.Module):
    """The student (trained, saved, exported) and a frozen teacher outside its parameters.

    The teacher is not a submodule: DeepSpeed neither partitions nor saves it, and the
    optimizer never sees it. `config` is the student's.
    """

    def __init__(
        self, student: tf.DistilBertForMaskedLM, teacher: tf.BertForMaskedLM, cfg: DistillConfig
    ):
        """Hold `student` as the trained module and freeze `teacher` beside it."""
        super().__init__()
        self.student = student
        self.config = student.config
        self.settings = cfg
        teacher.requires_grad_(False)
        teacher.train(False)
        self.__dict__["_teacher"] = teacher  # not registered: see the class docstring

    @property
    def teacher(self) -> tf.BertForMaskedLM:
        """The frozen teacher, moved to the student's device and dtype on first use."""
        teacher: tf.BertForMaskedLM = self.__dict__["_teacher"]
        weight = self.student.distilbert.embeddings.word_embeddings.weight
        if teacher.device != weight.device or teacher.dtype != weight.dtype:
            teacher.to(device=weight.device, dtype=weight.dtype)  # type: ignore[call-arg]
        return teacher

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """Not used: training/pretrain/losses/encoder.py runs teacher and student step by step."""
        raise NotImplementedError("use training.pretrain.losses.pretraining_loss")


def load_teacher(teacher_dir: Path) -> tf.BertForMaskedLM:
    """Load a BERT teacher with its masked-LM head from a local directory (safetensors only).

    Raises:
        DistillationError: the directory holds no BERT, or its MLM head weights are missing.
    """
    require_safetensors(teacher_dir)
    model_type = json.loads((teacher_dir / "config.json").read_text()).get("model_type")
    if model_type != "bert":
        raise DistillationError(
            f"{teacher_dir}: train.distillation.teacher must be a bert model, not {model_type!r}"
        )
    loaded: Any = tf.BertForMaskedLM.from_pretrained(
        teacher_dir, local_files_only=True, use_safetensors=True, output_loading_info=True
    )
    model, info = loaded
    missing = [k for k in info["missing_keys"] if not k.endswith("decoder.weight")]
    if missing:
        raise DistillationError(f"{teacher_dir}: the teacher lacks MLM head weights {missing}")
    model.config._attn_implementation = "sdpa"
    assert isinstance(model, tf.BertForMaskedLM)
    return model


def teacher_layers(teacher_layers_count: int, student_layers_count: int) -> list[int]:
    """The teacher layer each student layer starts from: every other one (0, 2, 4, ...)."""
    if student_layers_count > teacher_layers_count:
        raise DistillationError(
            f"train.distillation.student_layers={student_layers_count} exceeds the teacher's "
            f"{teacher_layers_count} layers"
        )
    step = teacher_layers_count / student_layers_count
    return [int(i * step) for i in range(student_layers_count)]


def student_config(
    teacher: tf.BertConfig, layers: int, dropout: float | None = None
) -> tf.DistilBertConfig:
    """A DistilBERT config of the teacher's width, vocabulary and positions, `layers` deep."""
    if teacher.hidden_act not in ("gelu", "relu"):
        raise DistillationError(f"DistilBERT has no {teacher.hidden_act!r} activation")
    config = tf.DistilBertConfig(
        vocab_size=teacher.vocab_size,
        max_position_embeddings=teacher.max_position_embeddings,
        n_layers=layers,
        n_heads=teacher.num_attention_heads,
        dim=teacher.hidden_size,
        hidden_dim=teacher.intermediate_size,
        activation=teacher.hidden_act,
        dropout=teacher.hidden_dropout_prob if dropout is None else dropout,
        attention_dropout=teacher.attention_probs_dropout_prob if dropout is None else dropout,
        pad_token_id=teacher.pad_token_id,
        initializer_range=teacher.initializer_range,
    )
    config._attn_implementation = "sdpa"
    return config


def init_student(student: tf.DistilBertForMaskedLM, teacher: tf.BertForMaskedLM) -> list[int]:
    """Copy the teacher's embeddings, every other layer and its MLM head into the student.

    DistilBERT has no token type embedding: the teacher's type-0 row (what single-segment
    inputs add) is folded into the position table, so the embeddings compute what the
    teacher's do. With as many student layers as teacher layers the student reproduces the
    teacher's MLM logits (checked in tests/training/models/test_distill.py).

    Returns:
        The teacher layer each student layer was copied from.
    """
    t_bert, s_bert = teacher.bert, student.distilbert
    picks = teacher_layers(len(t_bert.encoder.layer), len(s_bert.transformer.layer))
    with torch.no_grad():
        t_emb, s_emb = t_bert.embeddings, s_bert.embeddings
        s_emb.word_embeddings.weight.copy_(t_emb.word_embeddings.weight)
        s_emb.position_embeddings.weight.copy_(
            t_emb.position_embeddings.weight + t_emb.token_type_embeddings.weight[0]
        )
        s_emb.LayerNorm.load_state_dict(t_emb.LayerNorm.state_dict())
        s_layers: list[Any] = list(s_bert.transformer.layer)
        t_layers: list[Any] = list(t_bert.encoder.layer)
        for s_layer, index in zip(s_layers, picks, strict=True):
            t_layer = t_layers[index]
            attn = t_layer.attention
            pairs = [
                (s_layer.attention.q_lin, attn.self.query),
                (s_layer.attention.k_lin, attn.self.key),
                (s_layer.attention.v_lin, attn.self.value),
                (s_layer.attention.out_lin, attn.output.dense),
                (s_layer.sa_layer_norm, attn.output.LayerNorm),
                (s_layer.ffn.lin1, t_layer.intermediate.dense),
                (s_layer.ffn.lin2, t_layer.output.dense),
                (s_layer.output_layer_norm, t_layer.output.LayerNorm),
            ]
            for dst, src in pairs:
                dst.load_state_dict(src.state_dict())
        head = teacher.cls.predictions
        student.vocab_transform.load_state_dict(head.transform.dense.state_dict())
        student.vocab_layer_norm.load_state_dict(head.transform.LayerNorm.state_dict())
        student.vocab_projector.bias.copy_(head.bias)
    return picks


def build_distillation(
    teacher_dir: Path, cfg: DistillConfig, vocab_size: int, dropout: float | None = None
) -> DistillationModel:
    """Load the teacher, build the half-depth student from it (the caller seeds torch).

    Raises:
        DistillationError: the teacher is not a BERT, or its vocabulary is smaller than the
            tokenizer's `vocab_size`.
    """
    teacher = load_teacher(teacher_dir)
    if teacher.config.vocab_size < vocab_size:
        raise DistillationError(
            f"{teacher_dir}: the teacher's vocabulary ({teacher.config.vocab_size}) is smaller "
            f"than the tokenizer's ({vocab_size}); distill with the teacher's tokenizer"
        )
    layers = cfg.student_layers or max(1, teacher.config.num_hidden_layers // 2)
    student = tf.DistilBertForMaskedLM(student_config(teacher.config, layers, dropout))
    picks = init_student(student, teacher)
    log.info("student of %d layers from teacher layers %s", layers, picks)
    return DistillationModel(student, teacher, cfg)


def check_tokenizer(teacher_dir: Path, tokenizer_dir: Path) -> None:
    """Refuse a teacher whose vocabulary differs from the examples' tokenizer.

    Raises:
        DistillationError: naming the first differing token.
    """
    ours = tf.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).get_vocab()
    theirs = tf.AutoTokenizer.from_pretrained(teacher_dir, local_files_only=True).get_vocab()
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise DistillationError(
            f"the teacher at {teacher_dir} was trained with another tokenizer than "
            f"{tokenizer_dir} (differing entries {diff}); use the teacher's tokenizer"
        )
