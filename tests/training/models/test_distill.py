"""DistilBERT distillation: student shape and initialisation from the teacher, the triple loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

from training.models.distill import (
    DistillationError,
    DistillConfig,
    build_distillation,
    init_student,
    student_config,
    teacher_layers,
)
from training.pretrain.config import TrainConfig
from training.pretrain.losses import pretraining_loss


def teacher(tmp_path: Path, layers: int = 4, vocab: int = 120) -> tuple[Path, tf.BertConfig]:
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = tf.BertForPreTraining(config)  # what an lmpipe BERT export holds
    model.save_pretrained(tmp_path / "teacher")
    return tmp_path / "teacher", config


def batch(vocab: int = 120) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (3, 12), generator=gen)
    labels = torch.full_like(ids, -100)
    labels[:, 2::4] = ids[:, 2::4]
    ids = ids.masked_fill(labels != -100, 4)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_student_has_half_the_layers_from_every_other_teacher_layer(tmp_path: Path) -> None:
    path, config = teacher(tmp_path, layers=6)
    model = build_distillation(path, DistillConfig(teacher={"path": path}), 120)
    assert model.student.config.n_layers == config.num_hidden_layers // 2 == 3
    assert teacher_layers(6, 3) == [0, 2, 4]
    t_layer = model.teacher.bert.encoder.layer[2].attention.self.query.weight
    s_layer = model.student.distilbert.transformer.layer[1].attention.q_lin.weight
    assert torch.equal(s_layer, t_layer)
    # Only the student is trained, saved and exported.
    names = {name.split(".")[0] for name, _ in model.named_parameters()}
    assert names == {"student"}
    assert not any(p.requires_grad for p in model.teacher.parameters())


def test_full_depth_student_reproduces_the_teachers_mlm_logits(tmp_path: Path) -> None:
    path, config = teacher(tmp_path, layers=2)
    bert = tf.BertForMaskedLM.from_pretrained(path).eval()
    student = tf.DistilBertForMaskedLM(student_config(config, layers=2)).eval()
    assert init_student(student, bert) == [0, 1]
    ids = batch()["input_ids"]
    with torch.no_grad():
        expected = bert(input_ids=ids).logits
        got = student(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_triple_loss_parts_and_weights(tmp_path: Path) -> None:
    path, _ = teacher(tmp_path)
    cfg = DistillConfig(teacher={"path": path}, alpha_kd=5.0, alpha_mlm=2.0, alpha_cos=1.0)
    model = build_distillation(path, cfg, 120)
    out = pretraining_loss(model, "roberta", batch())
    parts = {k: float(v) for k, v in out.parts.items()}
    assert set(parts) == {"mlm_loss", "kd_loss", "cos_loss"}
    expected = 5.0 * parts["kd_loss"] + 2.0 * parts["mlm_loss"] + 1.0 * parts["cos_loss"]
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-6)
    # Every other teacher layer: the student starts close to the teacher, not at random.
    assert 0 <= parts["cos_loss"] < 0.5
    out.loss.backward()
    assert model.student.distilbert.embeddings.word_embeddings.weight.grad is not None


def test_teacher_must_be_a_bert_with_a_large_enough_vocabulary(tmp_path: Path) -> None:
    path, _ = teacher(tmp_path, vocab=120)
    with pytest.raises(DistillationError, match="smaller than the tokenizer's"):
        build_distillation(path, DistillConfig(teacher={"path": path}), 500)
    gpt = tmp_path / "gpt"
    tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2)).save_pretrained(gpt)
    with pytest.raises(DistillationError, match="must be a bert model, not 'gpt2'"):
        build_distillation(gpt, DistillConfig(teacher={"path": gpt}), 100)


def test_distillation_section_needs_the_distilbert_family(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"set train\.model\.family to distilbert"):
        TrainConfig.model_validate(
            {"model": {"family": "bert"}, "distillation": {"teacher": {"path": str(tmp_path)}}}
        )
