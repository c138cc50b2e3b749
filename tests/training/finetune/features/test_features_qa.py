"""SQuAD v2 style features (question + context windows, answer positions) and post-processing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tasks.common.schema import downstream_schema
from tasks.tokenizer.tokenizer import (
    PretrainedFiles,
    TokenizerConfig,
    load_tokenizer_files,
    to_transformers,
    train_tokenizer,
)
from training.finetune.features.features import FeatureConfig, FeatureError, Features, featurize
from training.finetune.features.qa import AnswerConfig, featurize_question_answering, postprocess_qa

VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    *["where", "is", "paris", "?", "the", "cat", "sat", "on", "mat", "in", "france", "."],
]
V = {token: i for i, token in enumerate(VOCAB)}
CONTEXT = "The cat sat on the mat in France."  # 9 tokens
QUESTION = "  Where is Paris?"  # 4 tokens once its leading spaces are dropped
CFG = FeatureConfig(max_length=13, stride=2)  # 13 - 3 specials - 4 = 6 context tokens a window


def wordpiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(vocab=V, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", V["[CLS]"]), ("[SEP]", V["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def qa_table(rows: list[tuple[str, str, list[str], list[int]]]) -> pa.Table:
    return pa.table(
        {
            "example_id": [f"q{i}" for i in range(len(rows))],
            "question": [r[0] for r in rows],
            "context": [r[1] for r in rows],
            "answer_texts": [r[2] for r in rows],
            "answer_starts": [r[3] for r in rows],
        },
        schema=downstream_schema("question_answering"),
    )


TABLE = qa_table(
    [
        (QUESTION, CONTEXT, ["France"], [26]),  # only in the second window
        (QUESTION, CONTEXT, [], []),  # unanswerable
        (QUESTION, CONTEXT, ["the mat"], [15]),  # in both windows (the overlap)
    ]
)


def test_windows_repeat_the_question_and_share_stride_context_tokens() -> None:
    features = featurize_question_answering(TABLE, wordpiece(), CFG)
    cls, sep = V["[CLS]"], V["[SEP]"]
    question = [cls, *(V[w] for w in ("where", "is", "paris", "?")), sep]
    first, second = features.inputs["input_ids"][:2]
    assert first.tolist() == [
        *question,
        *(V[w] for w in ["the", "cat", "sat", "on", "the", "mat"]),
        sep,
    ]
    assert second.tolist() == [*question, *(V[w] for w in ["the", "mat", "in", "france", "."]), sep]
    assert features.example_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert features.num_windowed == 3
    assert features.offsets is not None
    assert features.offsets[1][:7].tolist() == [[-1, -1]] * 6 + [[15, 18]]  # "the" of "the mat"


def test_answer_in_the_second_window_is_marked_there_and_null_elsewhere() -> None:
    features = featurize_question_answering(TABLE, wordpiece(), CFG)
    starts = features.inputs["start_positions"].tolist()
    ends = features.inputs["end_positions"].tolist()
    assert list(zip(starts, ends, strict=True)) == [
        (0, 0),  # "France" is not in window 1: the [CLS] (null) position
        (9, 9),  # [CLS] where is paris ? [SEP] the mat in >france<
        (0, 0),  # unanswerable
        (0, 0),
        (10, 11),  # "the mat" in window 1 ...
        (6, 7),  # ... and again in window 2
    ]
    assert features.null_index is not None
    assert features.null_index.tolist() == [0] * 6


def logits_at(features: Features, spans: dict[int, tuple[int, int, float]]):
    """Start/end logits 0 everywhere except `spans[feature] = (start, end, logit)`."""
    start = [np.zeros(len(row)) for row in features.inputs["input_ids"]]
    end = [np.zeros(len(row)) for row in features.inputs["input_ids"]]
    for f, (s, e, value) in spans.items():
        start[f][s] += value
        end[f][e] += value
    return start, end


def test_postprocess_maps_the_best_span_back_to_the_exact_context_string() -> None:
    features = featurize_question_answering(TABLE, wordpiece(), CFG)
    # example 0: the span "France" in window 2; example 2: "the mat in France" (6..9) in window 2
    start, end = logits_at(features, {1: (9, 9, 5.0), 5: (6, 9, 5.0)})
    for f in (2, 3):  # example 1: the null position wins in both of its windows
        start[f][0] = end[f][0] = 3.0
    predictions = postprocess_qa(TABLE, features, start, end, AnswerConfig())
    assert [p.text for p in predictions] == ["France", "", "the mat in France"]
    assert predictions[0].score == 10.0
    assert predictions[0].null_score == 0.0  # the lowest null score over the windows


def test_null_threshold_decides_between_span_and_no_answer() -> None:
    features = featurize_question_answering(TABLE, wordpiece(), CFG)
    start, end = logits_at(features, {1: (9, 9, 2.0)})
    for f in (0, 1):
        start[f][0] = end[f][0] = 3.0  # null 6 beats span 4 by 2
    table = TABLE.slice(0, 1)
    feats = Features(
        {k: v[:2] for k, v in features.inputs.items()},
        features.example_index[:2],
        1,
        offsets=features.offsets[:2] if features.offsets else None,
        null_index=features.null_index[:2] if features.null_index is not None else None,
    )
    assert postprocess_qa(table, feats, start[:2], end[:2], AnswerConfig())[0].text == ""
    lenient = AnswerConfig(null_threshold=2.5)
    assert postprocess_qa(table, feats, start[:2], end[:2], lenient)[0].text == "France"
    v1 = AnswerConfig(allow_unanswerable=False)
    assert postprocess_qa(table, feats, start[:2], end[:2], v1)[0].text == "France"


def test_spans_longer_than_max_answer_tokens_or_reversed_are_never_chosen() -> None:
    features = featurize_question_answering(TABLE, wordpiece(), CFG)
    start, end = logits_at(features, {5: (6, 9, 5.0)})  # a 4-token span
    end[5][7] += 1.0  # second best end: "the mat" (2 tokens)
    start[5][10] += 9.0  # "." starts high, but its only end scores low: (10, 10) = -11,
    end[5][10] -= 20.0  # and the reversed spans (10, 9) = 14 and (10, 7) = 10 are invalid
    predictions = postprocess_qa(TABLE, features, start, end, AnswerConfig(max_answer_tokens=3))
    assert predictions[2].text == "the mat"


def test_answer_start_that_does_not_point_at_the_answer_is_refused() -> None:
    table = qa_table([(QUESTION, CONTEXT, ["France"], [25])])
    with pytest.raises(FeatureError, match=r"'q0'.*'answer_starts' 25 does not point at"):
        featurize(table, wordpiece(), "question_answering", CFG)


def test_question_leaving_no_room_beyond_the_stride_is_refused() -> None:
    with pytest.raises(FeatureError, match=r"'q0': its question takes 4 .* leaving 2"):
        featurize_question_answering(TABLE, wordpiece(), FeatureConfig(max_length=9, stride=2))


@pytest.mark.parametrize("family", ["bpe", "unigram", "wordpiece"])
def test_gold_positions_round_trip_to_gold_answers_for_every_tokenizer_family(
    family: str,
) -> None:
    rng = random.Random(1)
    words = [a + b for a in ("ka", "lo", "mi", "te", "vo", "ni") for b in ("ran", "sul", "pe")]
    rows = []
    for i in range(30):
        context = " ".join(rng.choice(words) for _ in range(rng.randint(10, 60))) + "."
        if i % 4 == 3:
            rows.append(("what is " + rng.choice(words) + "?", context, [], []))
            continue
        tokens = context.split(" ")
        a = rng.randrange(len(tokens) - 3)
        answer = " ".join(tokens[a : a + rng.randint(1, 3)])
        rows.append(
            (
                "what is " + rng.choice(words) + "?",
                context,
                [answer],
                [len(" ".join(tokens[:a])) + bool(a)],
            )
        )
    table = qa_table(rows)
    cfg_tok = TokenizerConfig(family=family, vocab_size=300, min_frequency=1, extra_ids=0)
    tok = to_transformers(train_tokenizer([r[1] for r in rows], cfg_tok), cfg_tok)
    features = featurize_question_answering(table, tok, FeatureConfig(max_length=48, stride=8))
    assert features.num_windowed > 0
    spans = {
        f: (int(s), int(e), 10.0)
        for f, (s, e) in enumerate(
            zip(features.inputs["start_positions"], features.inputs["end_positions"], strict=True)
        )
    }
    start, end = logits_at(features, spans)  # gold positions; null (10 + 10) where no answer
    predictions = postprocess_qa(table, features, start, end, AnswerConfig())
    assert [p.text for p in predictions] == [r[2][0] if r[2] else "" for r in rows]


def real_tokenizer(shared: Path, family: str) -> PreTrainedTokenizerFast:
    """bert-base-uncased WordPiece or GPT-2 byte-level BPE, from the shared reference files."""
    if family == "wordpiece":
        files = PretrainedFiles(
            vocab_txt=str(shared / "bert_wordpiece_reference/bert-base-uncased-vocab.txt")
        )
        cfg = TokenizerConfig(family="wordpiece", vocab_size=30522)
    else:
        ref = shared / "gpt2_bpe_reference"
        files = PretrainedFiles(vocab_json=str(ref / "encoder.json"), merges=str(ref / "vocab.bpe"))
        cfg = TokenizerConfig(family="bpe", vocab_size=50257, lowercase=False)
    return to_transformers(load_tokenizer_files(files, cfg), cfg)


@pytest.mark.parametrize("family", ["wordpiece", "bpe"])
def test_squad_v2_sample_gold_spans_round_trip_with_real_vocabularies(
    shared_data: Path, family: str
) -> None:
    records = json.loads((shared_data / "hf_tests_samples/SQUAD/sample.json").read_text())["data"]
    rows = [
        (r["question"], r["context"], r["answers"]["text"], r["answers"]["answer_start"])
        for r in records
    ]
    table = qa_table(rows)
    features = featurize_question_answering(
        table, real_tokenizer(shared_data, family), FeatureConfig(max_length=96, stride=24)
    )
    assert features.num_windowed > 0  # the contexts are longer than one window
    spans = {
        f: (int(s), int(e), 10.0)
        for f, (s, e) in enumerate(
            zip(features.inputs["start_positions"], features.inputs["end_positions"], strict=True)
        )
    }
    start, end = logits_at(features, spans)
    predictions = postprocess_qa(table, features, start, end, AnswerConfig())
    assert [p.text for p in predictions] == [r[2][0] if r[2] else "" for r in rows]
    assert sum(not r[2] for r in rows) == 6  # the README's unanswerable count
