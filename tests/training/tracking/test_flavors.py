"""The signature each pipeline task is logged with: the one MLflow infers, without a prediction.

`task_signature` must equal what MLflow 3.17 infers by running the task's pipeline on the input
example `input_example` builds (`infer_or_get_default_signature`), so that a version logged with
it is indistinguishable from one whose signature MLflow inferred. Tiny random models, no store.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers

from training.tracking.flavors import input_example, task_signature

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["lmpipe", "serves", "this", "sentence", "models", "what", "does", "?", "."]
BERT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}


def tokenizer() -> tf.PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate([*SPECIALS, *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        eos_token="[SEP]",
    )


def tiny_model(task: str) -> Any:
    fields: dict[str, Any] = {"vocab_size": 64, "pad_token_id": 0}
    if task == "text-generation":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(
                n_embd=32,
                n_layer=1,
                n_head=2,
                n_positions=512,
                eos_token_id=3,
                bos_token_id=3,
                **fields,
            )
        )
    if task == "feature-extraction":
        return tf.ElectraModel(
            tf.ElectraConfig(embedding_size=16, intermediate_size=64, **BERT, **fields)
        )
    config = tf.BertConfig(
        intermediate_size=64, max_position_embeddings=512, num_labels=3, **BERT, **fields
    )
    heads = {
        "fill-mask": tf.BertForMaskedLM,
        "text-classification": tf.BertForSequenceClassification,
        "token-classification": tf.BertForTokenClassification,
    }
    return heads[task](config)


@pytest.mark.parametrize(
    "task",
    [
        "fill-mask",
        "text-classification",
        "token-classification",
        "feature-extraction",
        "text-generation",
    ],
)
def test_task_signature_is_the_one_mlflow_infers_from_the_input_example(
    task: str, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.transformers.signature import infer_or_get_default_signature

    tok = tokenizer()
    model = tiny_model(task).eval()
    pipe = tf.pipeline(task, model=model, tokenizer=tok)  # type: ignore[call-overload]

    with caplog.at_level(logging.WARNING, logger="mlflow"):
        inferred = infer_or_get_default_signature(pipe, example=input_example(task, tok))

    fallback = [r.message for r in caplog.records if r.name.startswith("mlflow")]
    assert not fallback  # inferred from a prediction, not MLflow's default for the task
    assert task_signature(task, model) == inferred


def test_question_answering_signature_takes_a_question_and_a_context() -> None:
    signature = task_signature("question-answering", None)

    assert signature.inputs.input_names() == ["question", "context"]
    assert set(input_example("question-answering", None)) == {"question", "context"}
