"""Features of classification, token classification, seq2seq and causal-LM tables; collators.

Exact expectations use hand-built vocabularies whose ids are known (WordPiece with a word that
splits into three pieces, word-level T5-like and GPT-like vocabularies); the token-label round
trip also runs on trained byte-level BPE and Unigram tokenizers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
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
from training.finetune.features.features import (
    Collator,
    FeatureConfig,
    FeatureError,
    aggregate_windows,
    causal_bos,
    featurize,
    featurize_causal_lm,
    featurize_classification,
    featurize_seq2seq,
    featurize_token_classification,
    make_collator,
    word_predictions,
)

WORDS = "the cat sat on mat un ##believ ##able paris is in france where ? . a dog ran"
WP_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS.split()]
WP = {token: i for i, token in enumerate(WP_VOCAB)}  # the=5 cat=6 sat=7 on=8 mat=9 un=10 ...
TAGS = ["O", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]


def wordpiece() -> PreTrainedTokenizerFast:
    """BERT-style tokenizer over the fixed vocabulary WP_VOCAB ("unbelievable" = 3 pieces)."""
    tok = Tokenizer(models.WordPiece(vocab=WP, unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", WP["[CLS]"]), ("[SEP]", WP["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def wordlevel(specials: list[str], eos_template: bool, **roles: str) -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer: specials first, then WORDS and "summarize" ":"."""
    vocab = {t: i for i, t in enumerate([*specials, *WORDS.split(), "summarize", ":"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=roles.get("unk_token", specials[0])))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos_template:  # T5: every sequence ends with </s>
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", vocab["</s>"])]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, **roles)


def t5_like() -> PreTrainedTokenizerFast:
    return wordlevel(["<pad>", "</s>", "<unk>"], True, pad_token="<pad>", eos_token="</s>")


def gpt_like() -> PreTrainedTokenizerFast:
    end = "<|endoftext|>"
    return wordlevel([end], False, eos_token=end, bos_token=end, unk_token=end)


def llama_like() -> PreTrainedTokenizerFast:
    return wordlevel(["<unk>", "<s>", "</s>"], False, bos_token="<s>", eos_token="</s>")


def ids(*words: str) -> list[int]:
    return [WP[w] for w in words]


def classification_table(texts: list[str], labels: list[int], pairs: list[str] | None = None):
    columns = {"example_id": [f"ex{i}" for i in range(len(texts))], "text": texts}
    if pairs is not None:
        columns["text_pair"] = pairs
    columns["label"] = labels
    return pa.table(columns, schema=downstream_schema("classification", pair=pairs is not None))


LONG = "the cat sat on the mat . a dog ran on paris"  # 12 tokens


def test_long_text_becomes_overlapping_windows_each_tagged_with_its_example() -> None:
    table = classification_table(["the cat sat", LONG], [1, 0])
    cfg = FeatureConfig(max_length=8, stride=2)  # 6 text tokens per window, 2 shared
    features = featurize_classification(table, wordpiece(), cfg, num_labels=2)
    cls, sep = WP["[CLS]"], WP["[SEP]"]
    expected = [
        [cls, *ids("the", "cat", "sat"), sep],
        [cls, *ids("the", "cat", "sat", "on", "the", "mat"), sep],
        [cls, *ids("the", "mat", ".", "a", "dog", "ran"), sep],
        [cls, *ids("dog", "ran", "on", "paris"), sep],
    ]
    assert [row.tolist() for row in features.inputs["input_ids"]] == expected
    assert features.example_index.tolist() == [0, 1, 1, 1]
    assert features.inputs["labels"].tolist() == [1, 0, 0, 0]
    assert (features.num_examples, features.num_windowed, features.num_truncated) == (2, 1, 0)
    assert features[2]["input_ids"].dtype == np.int64


def test_truncate_keeps_each_examples_first_window_and_counts_it() -> None:
    table = classification_table(["the cat sat", LONG], [1, 0])
    cfg = FeatureConfig(max_length=8, stride=2, truncation="truncate")
    features = featurize_classification(table, wordpiece(), cfg)
    assert features.example_index.tolist() == [0, 1]
    assert (features.num_windowed, features.num_truncated) == (0, 1)


def test_error_policy_refuses_a_long_example_by_its_id() -> None:
    table = classification_table(["the cat sat", LONG], [1, 0])
    with pytest.raises(FeatureError, match=r"1 example\(s\).*'ex1'"):
        featurize_classification(
            table, wordpiece(), FeatureConfig(max_length=8, stride=2, truncation="error")
        )


def test_pair_windows_slide_over_the_longer_text_and_repeat_the_shorter() -> None:
    table = classification_table(["where is paris ?", LONG], [1, 0], pairs=[LONG, "a dog"])
    features = featurize_classification(table, wordpiece(), FeatureConfig(max_length=13, stride=2))
    cls, sep = WP["[CLS]"], WP["[SEP]"]
    question = [cls, *ids("where", "is", "paris", "?"), sep]
    # example 0: second text windowed (13 - 3 specials - 4 = 6 tokens per window)
    assert features.inputs["input_ids"][0].tolist() == [
        *question,
        *ids("the", "cat", "sat", "on", "the", "mat"),
        sep,
    ]
    assert features.inputs["token_type_ids"][0].tolist() == [0] * 6 + [1] * 7
    # example 1: the first text is the longer one: windowed (8 per window), "a dog" repeated
    assert features.example_index.tolist() == [0, 0, 0, 1, 1]
    assert features.inputs["input_ids"][3].tolist() == [
        cls,
        *ids("the", "cat", "sat", "on", "the", "mat", ".", "a"),
        sep,
        *ids("a", "dog"),
        sep,
    ]
    assert features.num_windowed == 2


def test_pair_whose_kept_text_leaves_no_room_to_slide_is_refused() -> None:
    table = classification_table(["where is paris ?"], [0], pairs=[LONG])
    with pytest.raises(FeatureError, match=r"'ex0'.*leaving 2 per window"):
        featurize_classification(table, wordpiece(), FeatureConfig(max_length=9, stride=2))


def test_label_outside_the_label_list_is_refused_by_example_id() -> None:
    table = classification_table(["the cat", "a dog"], [1, 2])
    with pytest.raises(FeatureError, match="'ex1' has label 2, outside the 2 labels"):
        featurize(table, wordpiece(), "classification", FeatureConfig(), labels=["neg", "pos"])


def test_regression_labels_stay_float32() -> None:
    table = pa.table(
        {"example_id": ["a"], "text": ["the cat"], "label": [3.5]},
        schema=downstream_schema("regression"),
    )
    features = featurize(table, wordpiece(), "regression", FeatureConfig())
    assert features.inputs["labels"].dtype == np.float32
    assert Collator(0)([features[0]])["labels"].dtype == torch.float32


def test_aggregate_windows_mean_and_max_per_example() -> None:
    logits = np.array([[1.0, 0.0], [0.0, 4.0], [2.0, 2.0], [5.0, -1.0]])
    index = np.array([0, 1, 1, 1])
    mean = aggregate_windows(logits, index, 2, "mean")
    np.testing.assert_allclose(mean, [[1.0, 0.0], [7 / 3, 5 / 3]])
    np.testing.assert_allclose(aggregate_windows(logits, index, 2, "max"), [[1, 0], [5, 4]])
    with pytest.raises(ValueError, match="cover exactly 3"):
        aggregate_windows(logits, index, 3)


def token_table(words: list[list[str]], tags: list[list[int]]) -> pa.Table:
    return pa.table(
        {"example_id": [f"s{i}" for i in range(len(words))], "tokens": words, "tags": tags},
        schema=downstream_schema("token_classification"),
    )


def test_first_piece_of_each_word_carries_its_tag_and_other_pieces_minus_100() -> None:
    table = token_table([["Paris", "is", "unbelievable"]], [[1, 0, 3]])
    features = featurize_token_classification(table, wordpiece(), FeatureConfig(), TAGS)
    assert features.inputs["input_ids"][0].tolist() == [
        WP["[CLS]"],
        *ids("paris", "is", "un", "##believ", "##able"),
        WP["[SEP]"],
    ]
    assert features.inputs["labels"][0].tolist() == [-100, 1, 0, 3, -100, -100, -100]
    assert features.word_index is not None
    assert features.word_index[0].tolist() == [-1, 0, 1, 2, -1, -1, -1]


def test_label_all_tokens_labels_later_pieces_with_the_inside_tag() -> None:
    table = token_table([["Paris", "is", "unbelievable"]], [[1, 0, 3]])
    cfg = FeatureConfig(label_all_tokens=True)
    features = featurize_token_classification(table, wordpiece(), cfg, TAGS)
    assert features.inputs["labels"][0].tolist() == [-100, 1, 0, 3, 4, 4, -100]


def test_word_predictions_map_window_pieces_back_to_every_word() -> None:
    words = ["the", "cat", "sat", "on", "the", "mat", ".", "a", "dog", "ran", "on", "unbelievable"]
    tags = [0, 1, 2, 0, 0, 3, 0, 0, 1, 0, 0, 3]
    table = token_table([words, ["Paris"]], [tags, [1]])
    cfg = FeatureConfig(max_length=8, stride=2)
    features = featurize_token_classification(table, wordpiece(), cfg, TAGS)
    assert features.example_index.tolist() == [0, 0, 0, 1]
    assert features.num_windowed == 1
    # gold labels as logits: every first piece scores its tag; windows agree where they overlap
    logits = [np.eye(len(TAGS))[np.where(row < 0, 0, row)] for row in features.inputs["labels"]]
    predicted = word_predictions(features, logits, TAGS)
    assert predicted == [[TAGS[t] for t in tags], ["B-LOC"]]


def test_words_cut_off_by_truncation_are_predicted_o() -> None:
    words = ["the", "cat", "sat", "on", "the", "mat", ".", "a"]
    table = token_table([words], [[1] * len(words)])
    cfg = FeatureConfig(max_length=8, stride=2, truncation="truncate")
    features = featurize_token_classification(table, wordpiece(), cfg, TAGS)
    logits = [np.eye(len(TAGS))[np.where(row < 0, 0, row)] for row in features.inputs["labels"]]
    assert word_predictions(features, logits, TAGS) == [["B-LOC"] * 6 + ["O"] * 2]


def test_tags_and_words_of_different_lengths_are_refused_by_example_id() -> None:
    with pytest.raises(FeatureError, match="'s0': 2 'tokens' but 1 'tags'"):
        featurize_token_classification(
            token_table([["a", "b"]], [[0]]), wordpiece(), FeatureConfig(), TAGS
        )


@pytest.mark.parametrize("family", ["bpe", "unigram", "wordpiece"])
def test_gold_tags_round_trip_through_pieces_for_every_tokenizer_family(family: str) -> None:
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ran", "te", "sul", "vo", "ni"]
    vocab = [a + b + c for a in syllables for b in syllables for c in syllables[:3]]
    sentences = [[rng.choice(vocab) for _ in range(rng.randint(3, 30))] for _ in range(40)]
    cfg_tok = TokenizerConfig(family=family, vocab_size=300, min_frequency=1, extra_ids=0)
    tok = to_transformers(train_tokenizer([" ".join(s) for s in sentences[:20]], cfg_tok), cfg_tok)
    tags = [[rng.randrange(len(TAGS)) for _ in s] for s in sentences]
    features = featurize_token_classification(
        token_table(sentences, tags), tok, FeatureConfig(max_length=24, stride=4), TAGS
    )
    assert features.num_windowed > 0  # some sentences span several windows
    logits = [np.eye(len(TAGS))[np.where(row < 0, 0, row)] for row in features.inputs["labels"]]
    assert word_predictions(features, logits, TAGS) == [[TAGS[t] for t in row] for row in tags]


def test_seq2seq_prefixes_the_source_and_pads_labels_with_minus_100() -> None:
    tok = t5_like()
    vocab = tok.get_vocab()
    table = pa.table(
        {
            "example_id": ["a", "b"],
            "text": ["the cat sat on the mat", "a dog"],
            "target": ["cat on mat", "dog"],
        },
        schema=downstream_schema("seq2seq"),
    )
    features = featurize_seq2seq(table, tok, FeatureConfig(), source_prefix="summarize : ")
    words = ["summarize", ":", "the", "cat", "sat", "on", "the", "mat"]
    assert features.inputs["input_ids"][0].tolist() == [vocab[w] for w in words] + [1]
    batch = make_collator("seq2seq", tok)([features[0], features[1]])
    cat_on_mat = [vocab[w] for w in ("cat", "on", "mat")]
    assert batch["labels"].tolist() == [[*cat_on_mat, 1], [vocab["dog"], 1, -100, -100]]
    assert batch["attention_mask"][1].tolist() == [1] * 5 + [0] * 4  # summarize : a dog </s>
    assert batch["input_ids"][1, 5:].tolist() == [0] * 4  # <pad>


def test_seq2seq_targets_are_cut_to_max_target_length_keeping_eos() -> None:
    table = pa.table(
        {"example_id": ["a"], "text": ["a dog"], "target": ["the cat sat on the mat"]},
        schema=downstream_schema("seq2seq"),
    )
    features = featurize_seq2seq(table, t5_like(), FeatureConfig(max_target_length=4))
    assert features.inputs["labels"][0].tolist()[-1] == 1  # </s>
    assert len(features.inputs["labels"][0]) == 4
    assert features.num_truncated == 1
    with pytest.raises(FeatureError, match=r"column 'target'.*'a'"):
        featurize_seq2seq(table, t5_like(), FeatureConfig(max_target_length=4, truncation="error"))


def causal_table(prompts: list[str], responses: list[str]) -> pa.Table:
    return pa.table(
        {
            "example_id": [f"c{i}" for i in range(len(prompts))],
            "prompt": prompts,
            "response": responses,
        },
        schema=downstream_schema("causal_lm"),
    )


def test_causal_lm_labels_mask_the_prompt_and_padding_exactly() -> None:
    tok = gpt_like()
    v = tok.get_vocab()
    assert causal_bos(tok) == []  # bos = eos: GPT-2 prompts start bare
    table = causal_table(["the cat", "a"], ["sat on the mat", "dog"])
    features = featurize_causal_lm(table, tok, FeatureConfig())
    batch = make_collator("causal_lm", tok)([features[0], features[1]])
    eos = v["<|endoftext|>"]
    the, cat, sat, on, mat, a, dog = (v[w] for w in ("the", "cat", "sat", "on", "mat", "a", "dog"))
    assert batch["input_ids"].tolist() == [
        [the, cat, sat, on, the, mat, eos],
        [a, dog, eos, eos, eos, eos, eos],
    ]
    assert batch["labels"].tolist() == [
        [-100, -100, sat, on, the, mat, eos],
        [-100, dog, eos, -100, -100, -100, -100],
    ]
    assert batch["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]


def test_causal_lm_with_a_bos_vocabulary_masks_bos_as_prompt() -> None:
    tok = llama_like()
    v = tok.get_vocab()
    features = featurize_causal_lm(causal_table(["a"], ["dog"]), tok, FeatureConfig())
    assert features.inputs["input_ids"][0].tolist() == [v["<s>"], v["a"], v["dog"], v["</s>"]]
    assert features.inputs["labels"][0].tolist() == [-100, -100, v["dog"], v["</s>"]]


def test_causal_lm_too_long_loses_prompt_start_then_response_end() -> None:
    tok = gpt_like()
    v = tok.get_vocab()
    table = causal_table(["the cat sat on the mat", "a"], ["a dog ran", "dog ran on the mat ."])
    features = featurize_causal_lm(table, tok, FeatureConfig(max_length=8, stride=2))
    eos = v["<|endoftext|>"]
    # 6 + 4 > 8: the prompt keeps its last 4 tokens, the response (with eos) is whole
    assert features.inputs["input_ids"][0].tolist() == [
        *(v[w] for w in ["sat", "on", "the", "mat", "a", "dog", "ran"]),
        eos,
    ]
    # 1 + 7 = 8 fits exactly
    assert features.inputs["labels"][1].tolist()[-1] == eos
    assert features.num_truncated == 1
    with pytest.raises(FeatureError, match="'c0'"):
        featurize_causal_lm(table, tok, FeatureConfig(max_length=8, stride=2, truncation="error"))


def test_collator_pads_left_to_a_multiple_and_refuses_unknown_columns() -> None:
    rows = [
        {"input_ids": np.array([5, 6, 7]), "attention_mask": np.array([1, 1, 1])},
        {"input_ids": np.array([8]), "attention_mask": np.array([1])},
    ]
    batch = Collator(0, "left", pad_to_multiple_of=4)(rows)
    assert batch["input_ids"].tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    with pytest.raises(ValueError, match="'offsets'"):
        Collator(0)([{"offsets": np.array([1, 2])}])


def test_featurize_refuses_an_unknown_task_type() -> None:
    with pytest.raises(ValueError, match="unknown task type 'ranking'"):
        featurize(classification_table(["a"], [0]), wordpiece(), "ranking", FeatureConfig())


@pytest.mark.parametrize("family", ["wordpiece", "bpe"])
def test_conll_sample_tags_round_trip_with_real_vocabularies(
    shared_data: Path, family: str
) -> None:
    lines = (shared_data / "hf_tests_samples/conll/sample.json").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    names = sorted({tag for r in records for tag in r["ner"]})
    table = token_table(
        [r["words"] for r in records], [[names.index(t) for t in r["ner"]] for r in records]
    )
    if family == "wordpiece":
        vocab = shared_data / "bert_wordpiece_reference/bert-base-uncased-vocab.txt"
        files = PretrainedFiles(vocab_txt=str(vocab))
        cfg = TokenizerConfig(family="wordpiece", vocab_size=30522)
    else:
        ref = shared_data / "gpt2_bpe_reference"
        files = PretrainedFiles(vocab_json=str(ref / "encoder.json"), merges=str(ref / "vocab.bpe"))
        cfg = TokenizerConfig(family="bpe", vocab_size=50257, lowercase=False)
    tok = to_transformers(load_tokenizer_files(files, cfg), cfg)
    features = featurize_token_classification(
        table, tok, FeatureConfig(max_length=16, stride=4), names
    )
    assert features.num_windowed > 0
    logits = [np.eye(len(names))[np.where(row < 0, 0, row)] for row in features.inputs["labels"]]
    assert word_predictions(features, logits, names) == [r["ner"] for r in records]
