"""Metric correctness against values computed by hand (in the comments) on fixed predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tasks.common.schema import DOWNSTREAM_TASK_TYPES
from training.scoring.metrics.metrics import (
    auc_roc,
    classification_metrics,
    compute_metrics,
    cosine_similarities,
    embedding_similarity_metrics,
    generation_metrics,
    masked_lm_accuracy,
    perplexity,
    primary_metric,
    regression_metrics,
    token_classification_metrics,
)
from training.scoring.metrics.squad import (
    answer_exact_match,
    answer_f1,
    normalize_answer,
    squad_metrics,
)

approx = pytest.approx

# --- classification ------------------------------------------------------------------------

# Imbalanced 3-class case: six 0s, two 1s, two 2s; one 1 and one 2 are predicted as 0.
IMBALANCED_REFS = [0, 0, 0, 0, 0, 0, 1, 1, 2, 2]
IMBALANCED_PREDS = [0, 0, 0, 0, 0, 0, 0, 1, 0, 2]


def test_macro_and_micro_averages_differ_on_an_imbalanced_three_class_example() -> None:
    out = classification_metrics(IMBALANCED_PREDS, IMBALANCED_REFS, labels=[0, 1, 2])
    # class 0: TP 6, FP 2, FN 0 -> P 6/8, R 1, F 2*(3/4)/(7/4) = 6/7
    # class 1: TP 1, FP 0, FN 1 -> P 1, R 1/2, F 2/3; class 2: the same
    assert out["precision_macro"] == approx((3 / 4 + 1 + 1) / 3)
    assert out["recall_macro"] == approx((1 + 1 / 2 + 1 / 2) / 3)
    assert out["f1_macro"] == approx((6 / 7 + 2 / 3 + 2 / 3) / 3)  # 46/63 = 0.7302
    # micro pools the counts: TP 8, FP 2, FN 2 -> P = R = F = 0.8 = accuracy
    assert out["precision_micro"] == approx(0.8)
    assert out["recall_micro"] == approx(0.8)
    assert out["f1_micro"] == approx(0.8)
    assert out["accuracy"] == approx(0.8)
    # weighted by support 6/2/2
    assert out["f1_weighted"] == approx((6 * 6 / 7 + 2 * 2 / 3 + 2 * 2 / 3) / 10)
    assert out["f1_macro"] != approx(out["f1_micro"])


def test_multiclass_mcc_matches_the_hand_computed_value() -> None:
    out = classification_metrics(IMBALANCED_PREDS, IMBALANCED_REFS, labels=[0, 1, 2])
    # Gorodkin's R_K: c = 8 correct of s = 10; predicted counts p = (8, 1, 1), true t = (6, 2, 2)
    # (c*s - sum p*t) / sqrt((s^2 - sum p^2)(s^2 - sum t^2)) = (80 - 52) / sqrt(34 * 56)
    assert out["mcc"] == approx(28 / math.sqrt(34 * 56))  # 0.6417


def test_binary_mcc_and_positive_class_f1() -> None:
    # TP 2, FN 1, TN 2, FP 1
    out = classification_metrics([1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0], labels=[0, 1])
    assert out["mcc"] == approx((2 * 2 - 1 * 1) / math.sqrt(3 * 3 * 3 * 3))  # 1/3
    assert out["f1_positive"] == approx(2 / 3)  # P = R = 2/3
    assert "auc_roc" not in out  # label predictions carry no scores


def test_absent_classes_count_as_zero_in_the_macro_average() -> None:
    # labels 0..3; class 3 never occurs, class 2 is only predicted (once, wrongly)
    # per class F1: 0 -> P 1, R 1/2, F 2/3; 1 -> 1; 2 -> 0; 3 -> 0 (zero_division=0)
    out = classification_metrics([0, 2, 1], [0, 0, 1], labels=[0, 1, 2, 3])
    assert out["f1_macro"] == approx((2 / 3 + 1 + 0 + 0) / 4)  # 5/12
    fewer = classification_metrics([0, 2, 1], [0, 0, 1], labels=[0, 1, 2])
    assert fewer["f1_macro"] == approx((2 / 3 + 1 + 0) / 3)  # 5/9


def test_probability_columns_follow_the_label_order() -> None:
    probs = [[0.8, 0.2], [0.3, 0.7]]
    right = classification_metrics(probs, ["neg", "pos"], labels=["neg", "pos"])
    swapped = classification_metrics(probs, ["neg", "pos"], labels=["pos", "neg"])
    assert right["accuracy"] == 1.0
    assert swapped["accuracy"] == 0.0


def test_binary_auc_counts_correctly_ordered_positive_negative_pairs() -> None:
    # positives score 0.35 and 0.8, negatives 0.1 and 0.4: 3 of the 4 pairs are ordered right
    assert auc_roc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8], labels=[0, 1]) == approx(0.75)
    probs = [[0.9, 0.1], [0.6, 0.4], [0.65, 0.35], [0.2, 0.8]]
    out = classification_metrics(probs, [0, 0, 1, 1], labels=[0, 1])
    assert out["auc_roc"] == approx(0.75)
    assert out["accuracy"] == approx(0.75)  # arg-max predicts 0, 0, 0, 1


def test_multiclass_auc_is_the_one_vs_rest_macro_average() -> None:
    probs = [[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.3, 0.6], [0.5, 0.2, 0.3]]
    # class 0: 0.6 beats 0.2, 0.1, 0.5 -> 1; class 1: 0.5 beats 0.3, 0.3, 0.2 -> 1
    # class 2: positives 0.6, 0.3 vs negatives 0.1, 0.3 -> 1 + 1 + 1 + 0.5 (tie) = 3.5 / 4
    assert auc_roc([0, 1, 2, 2], probs, labels=[0, 1, 2]) == approx((1 + 1 + 0.875) / 3)


def test_multiclass_auc_leaves_out_a_class_absent_from_the_references() -> None:
    probs = [[0.7, 0.2, 0.1], [0.3, 0.3, 0.4], [0.4, 0.5, 0.1], [0.2, 0.7, 0.1]]
    # class 0: positives 0.7, 0.4 beat negatives 0.3, 0.2 -> 1
    # class 1: positives 0.3, 0.7 vs negatives 0.2, 0.5 -> 3 of 4 pairs; class 2 never occurs
    assert auc_roc([0, 1, 0, 1], probs, labels=[0, 1, 2]) == approx((1 + 0.75) / 2)


def test_auc_with_a_single_reference_class_is_an_error() -> None:
    with pytest.raises(ValueError, match="only class"):
        auc_roc([1, 1, 1], [0.2, 0.5, 0.9], labels=[0, 1])


def test_classification_names_an_unknown_label_and_its_index() -> None:
    with pytest.raises(ValueError, match=r"predictions\[2\] = 7 is not a known label"):
        classification_metrics([0, 1, 7], [0, 1, 1], labels=[0, 1])
    with pytest.raises(ValueError, match=r"references\[0\] = 'maybe'"):
        classification_metrics(["yes"], ["maybe"], labels=["no", "yes"])


def test_classification_refuses_misaligned_or_unnormalised_input() -> None:
    with pytest.raises(ValueError, match="2 predictions but 3 references"):
        classification_metrics([0, 1], [0, 1, 1], labels=[0, 1])
    with pytest.raises(ValueError, match="row 1 is not a probability distribution"):
        classification_metrics([[0.5, 0.5], [2.0, -1.0]], [0, 1], labels=[0, 1])
    with pytest.raises(ValueError, match="labels"):
        compute_metrics("classification", [0], [0])


# --- regression -----------------------------------------------------------------------------


def test_regression_pearson_spearman_and_mse_by_hand() -> None:
    # deviations from the mean 2: x (-1, 0, 1), y (-1, 1, 0) -> r = 1 / sqrt(2 * 2) = 0.5;
    # the values are their own ranks, so Spearman is 0.5 too; MSE = (0 + 1 + 1) / 3
    out = regression_metrics([1.0, 2.0, 3.0], [1.0, 3.0, 2.0])
    assert out == approx({"pearson": 0.5, "spearman": 0.5, "mse": 2 / 3})


def test_spearman_sees_only_the_ranks_and_pearson_the_values() -> None:
    out = regression_metrics(np.array([[1.0], [2.0], [3.0], [4.0]]), [1.0, 4.0, 9.0, 100.0])
    assert out["spearman"] == approx(1.0)
    assert out["pearson"] < 0.9


def test_regression_with_constant_predictions_gives_nan_correlations() -> None:
    out = regression_metrics([2.0, 2.0, 2.0], [1.0, 2.0, 3.0])
    assert math.isnan(out["pearson"])
    assert out["mse"] == approx(2 / 3)


# --- token classification (seqeval) ---------------------------------------------------------


def test_an_i_tag_without_b_is_an_entity_by_default_but_not_in_strict_mode() -> None:
    out = token_classification_metrics([["I-PER", "I-PER", "O"]], [["B-PER", "I-PER", "O"]])
    # default (conlleval): I-PER after O opens PER over tokens 0-1, which matches the gold
    assert out["entity_f1"] == 1.0
    # strict IOB2: only B- opens an entity, so nothing is predicted: P = R = F = 0
    assert out["entity_precision_strict"] == 0.0
    assert out["entity_f1_strict"] == 0.0


@pytest.mark.parametrize("suffix", ["", "_strict"])
def test_a_boundary_mismatch_scores_no_entity(suffix: str) -> None:
    out = token_classification_metrics([["B-LOC", "O", "O"]], [["B-LOC", "I-LOC", "O"]])
    assert out[f"entity_precision{suffix}"] == 0.0  # LOC(0) is not LOC(0-1)
    assert out[f"entity_recall{suffix}"] == 0.0


@pytest.mark.parametrize("suffix", ["", "_strict"])
def test_adjacent_entities_of_one_type_are_two_entities(suffix: str) -> None:
    gold = [["B-PER", "B-PER", "O"]]  # PER(0) and PER(1)
    assert token_classification_metrics(gold, gold)[f"entity_f1{suffix}"] == 1.0
    merged = token_classification_metrics([["B-PER", "I-PER", "O"]], gold)
    assert merged[f"entity_f1{suffix}"] == 0.0  # PER(0-1) matches neither


@pytest.mark.parametrize("suffix", ["", "_strict"])
def test_an_entity_at_the_end_of_the_sequence_is_counted(suffix: str) -> None:
    # reference ORG(1-2) closes at the sequence end; the prediction ORG(2) does not match it
    out = token_classification_metrics([["O", "O", "B-ORG"]], [["O", "B-ORG", "I-ORG"]])
    assert out[f"entity_recall{suffix}"] == 0.0
    same = token_classification_metrics([["O", "B-ORG", "I-ORG"]], [["O", "B-ORG", "I-ORG"]])
    assert same[f"entity_f1{suffix}"] == 1.0


def test_entity_scores_are_micro_averaged_over_the_corpus_in_both_modes() -> None:
    refs = [
        ["B-PER", "I-PER", "O"],
        ["B-LOC", "I-LOC", "O"],
        ["B-PER", "B-PER", "O"],
        ["O", "B-ORG", "I-ORG"],
    ]
    preds = [
        ["I-PER", "I-PER", "O"],
        ["B-LOC", "O", "O"],
        ["B-PER", "I-PER", "O"],
        ["O", "B-ORG", "I-ORG"],
    ]
    out = token_classification_metrics(preds, refs)
    # 5 gold entities. default: 4 predicted (PER 0-1 ok, LOC 0, PER 0-1, ORG ok) -> 2 right
    assert out["entity_precision"] == approx(2 / 4)
    assert out["entity_recall"] == approx(2 / 5)
    assert out["entity_f1"] == approx(2 * 0.5 * 0.4 / 0.9)  # 4/9
    # strict: the orphan I-PER is dropped -> 3 predicted, only ORG right
    assert out["entity_precision_strict"] == approx(1 / 3)
    assert out["entity_recall_strict"] == approx(1 / 5)
    assert out["entity_f1_strict"] == approx(2 * (1 / 15) / (8 / 15))  # 0.25
    assert out["token_accuracy"] == approx(9 / 12)  # one wrong tag in each of the first three


def test_token_classification_names_the_bad_tag_and_its_position() -> None:
    with pytest.raises(ValueError, match=r"predictions\[0\]\[1\] = 'X-PER'"):
        token_classification_metrics([["O", "X-PER"]], [["O", "B-PER"]])
    with pytest.raises(ValueError, match=r"predictions\[1\] must be a list of 2 tags"):
        token_classification_metrics([["O"], ["O"]], [["O"], ["O", "O"]])
    with pytest.raises(ValueError, match=r"references\[0\]\[0\] = 'B-MISC'"):
        token_classification_metrics([["O"]], [["B-MISC"]], labels=["O", "B-PER", "I-PER"])


# --- extractive QA (SQuAD) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("The Eiffel Tower", "eiffel tower"),  # case and a leading article
        ("An apple a day", "apple day"),  # every article, as whole words only
        ("Theatre of the Absurd", "theatre of absurd"),  # "the" inside a word stays
        ("  Quick,\tbrown-fox!\n", "quick brownfox"),  # punctuation deleted, whitespace folded
        ("a.m.", "am"),  # "a" glued to its dots is no article
        ("The", ""),
    ],
)
def test_squad_normalisation(raw: str, normalised: str) -> None:
    assert normalize_answer(raw) == normalised


def test_squad_exact_match_ignores_case_articles_and_punctuation() -> None:
    assert answer_exact_match("the Eiffel  Tower.", "Eiffel Tower") == 1.0
    assert answer_exact_match("Eiffel", "Eiffel Tower") == 0.0


def test_squad_f1_on_partial_overlap() -> None:
    # prediction tokens in, year, 1998, maybe vs gold 1998: P 1/4, R 1 -> 2*(1/4)/(5/4) = 0.4
    assert answer_f1("in the year 1998, maybe", "1998") == approx(0.4)
    # repeated tokens are clipped: common = min(2, 1) = 1 -> P 1/2, R 1 -> 2/3
    assert answer_f1("Paris paris", "Paris") == approx(2 / 3)
    assert answer_f1("London", "Paris") == 0.0


def test_squad_takes_the_best_of_several_gold_answers() -> None:
    # vs "Denver Broncos": P 1/2, R 1/2 -> 1/2; vs "Broncos": P 1/2, R 1 -> 2/3
    out = squad_metrics(["the Broncos won"], [["Denver Broncos", "Broncos"]])
    assert out["f1"] == approx(2 / 3)
    assert out["exact_match"] == 0.0
    out = squad_metrics(["Denver Broncos"], [["Broncos", "The Denver Broncos"]])
    assert out["exact_match"] == 1.0


def test_squad_unanswerable_questions_score_only_the_empty_answer() -> None:
    right = squad_metrics([""], [[]])
    wrong = squad_metrics(["Paris"], [[]])
    assert (right["exact_match"], right["f1"]) == (1.0, 1.0)
    assert (wrong["exact_match"], wrong["f1"]) == (0.0, 0.0)
    # a gold answer that normalises to nothing ("The") counts as no answer, as in the script
    assert squad_metrics([""], [["The"]])["no_ans_total"] == 1.0
    assert squad_metrics([""], [["Santa Clara"]])["f1"] == 0.0


def test_squad_breaks_scores_down_into_answerable_and_unanswerable() -> None:
    predictions = ["Denver Broncos", "the broncos won", "", "Paris", ""]
    references = [["Denver Broncos"], ["Denver Broncos", "Broncos"], [], [], ["Santa Clara"]]
    # per question (EM, F1): (1, 1) (0, 2/3) | no answer: (1, 1) (0, 0) | (0, 0)
    out = squad_metrics(predictions, references)
    assert out["exact_match"] == approx(2 / 5)
    assert out["f1"] == approx((1 + 2 / 3 + 1 + 0 + 0) / 5)  # 8/15
    assert out["has_ans_exact_match"] == approx(1 / 3)
    assert out["has_ans_f1"] == approx((1 + 2 / 3 + 0) / 3)  # 5/9
    assert out["no_ans_exact_match"] == approx(1 / 2)
    assert out["no_ans_f1"] == approx(1 / 2)
    assert (out["has_ans_total"], out["no_ans_total"]) == (3.0, 2.0)


def test_squad_refuses_a_bare_string_as_gold_answers() -> None:
    with pytest.raises(ValueError, match="reference 0 must be a list of answer strings"):
        squad_metrics(["Paris"], ["Paris"])


# --- generation (sacrebleu, rouge-score) ----------------------------------------------------


def test_bleu_matches_the_hand_computed_modified_precisions() -> None:
    # hyp "the cat sat on the mat" vs ref "the cat sat on a mat" (13a: 6 tokens each, BP = 1)
    # clipped n-gram precisions: 1g 5/6, 2g 3/5, 3g 2/4, 4g 1/3 -> geometric mean (1/12)^(1/4)
    out = generation_metrics(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert out["bleu"] == approx(100 * (1 / 12) ** 0.25)  # 53.73


def test_bleu_is_corpus_level_with_a_brevity_penalty() -> None:
    hyps = ["the cat sat on the mat", "the cat sat on"]
    refs = ["the cat sat on a mat", "the cat sat on the mat"]
    # pooled counts: 1g 9/10, 2g 6/8, 3g 4/6, 4g 2/4; hyp 10 tokens, ref 12 -> BP exp(1 - 12/10)
    expected = 100 * math.exp(-0.2) * (0.9 * 0.75 * (2 / 3) * 0.5) ** 0.25  # 56.39
    assert generation_metrics(hyps, refs)["bleu"] == approx(expected)
    # a lone short hypothesis: every precision 1, BP exp(1 - 6/4)
    short = generation_metrics(["the cat sat on"], ["the cat sat on the mat"])
    assert short["bleu"] == approx(100 * math.exp(-0.5))


def test_bleu_and_chrf_with_several_references_and_extreme_cases() -> None:
    two_refs = [["the cat sat on a mat", "the cat sat on the mat"]]
    assert generation_metrics(["the cat sat on the mat"], two_refs)["bleu"] == approx(100.0)
    assert generation_metrics(["abc def"], ["abc def"])["chrf"] == approx(100.0)
    assert generation_metrics(["xyz"], ["abc"])["chrf"] == 0.0


def test_rouge_is_the_stemmed_f_measure_averaged_over_examples() -> None:
    # ex 1: "the cat lay on the mat" vs "the cat sat on the mat": unigrams 5/6 each way,
    #       bigrams 3 of 5 (the cat, on the, the mat), LCS 5 of 6 -> F 5/6, 3/5, 5/6
    # ex 2: stemming makes "cat runs" and "cats running" both "cat run" -> F 1, 1, 1
    out = generation_metrics(
        ["the cat lay on the mat", "cat runs"], ["the cat sat on the mat", "cats running"]
    )
    assert out["rouge1"] == approx((5 / 6 + 1) / 2)
    assert out["rouge2"] == approx((3 / 5 + 1) / 2)
    assert out["rougeL"] == approx((5 / 6 + 1) / 2)


def test_rouge_l_follows_word_order_and_rouge_1_does_not() -> None:
    # reversed: all four unigrams match, no bigram does, the longest common subsequence is 1
    out = generation_metrics(["four three two one"], ["one two three four"])
    assert (out["rouge1"], out["rouge2"], out["rougeL"]) == approx((1.0, 0.0, 0.25))


def test_generation_needs_the_same_number_of_references_per_example() -> None:
    with pytest.raises(ValueError, match="same number"):
        generation_metrics(["a", "b"], [["a"], ["b", "c"]])


# --- language modelling and embeddings ------------------------------------------------------


def test_perplexity_is_exp_of_the_mean_nll() -> None:
    assert perplexity(3 * math.log(4.0), 3) == approx(4.0)
    assert perplexity(0.0, 10) == 1.0
    assert perplexity(1e6, 1) == math.inf  # exp(1e6) overflows a float: guarded
    with pytest.raises(ValueError, match="token_count"):
        perplexity(1.0, 0)
    with pytest.raises(ValueError, match="negative"):
        perplexity(-1.0, 2)


def test_masked_lm_accuracy_scores_only_labelled_positions() -> None:
    # scored: (0,0) 5 = 5 right, (0,2) 7 != 0 wrong, (1,1) 2 = 2 right -> 2/3
    preds = np.array([[5, 6, 7], [1, 2, 3]])
    labels = np.array([[5, -100, 0], [-100, 2, -100]])
    assert masked_lm_accuracy(preds, labels) == approx(2 / 3)
    with pytest.raises(ValueError, match="ignore_index"):
        masked_lm_accuracy(preds, np.full((2, 3), -100))


def test_cosine_similarity_of_embedding_pairs() -> None:
    left = [[1.0, 0.0], [1.0, 1.0], [3.0, 4.0], [1.0, 2.0]]
    right = [[0.0, 1.0], [2.0, 2.0], [4.0, 3.0], [-1.0, -2.0]]
    # orthogonal 0, parallel 1, (12 + 12) / (5 * 5) = 0.96, opposite -1
    assert cosine_similarities(left, right) == approx([0.0, 1.0, 0.96, -1.0])
    with pytest.raises(ValueError, match="row 1 has a zero embedding"):
        cosine_similarities([[1.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]])


def test_sts_protocol_correlates_cosines_with_gold_scores() -> None:
    left = [[1.0, 0.0], [1.0, 1.0], [3.0, 4.0], [1.0, 2.0]]
    right = [[0.0, 1.0], [2.0, 2.0], [4.0, 3.0], [-1.0, -2.0]]
    gold = [0.5, 5.0, 4.0, 0.0]
    out = embedding_similarity_metrics(left, right, gold)
    # cosines (0, 1, 0.96, -1) rank like gold (0.5, 5, 4, 0) -> Spearman 1
    assert out["cosine_spearman"] == approx(1.0)
    # deviations dx (-.24, .76, .72, -1.24), dy (-1.875, 2.625, 1.625, -2.375):
    # sum dx*dy = 6.56, sum dx^2 = 2.6912, sum dy^2 = 18.6875
    assert out["cosine_pearson"] == approx(6.56 / math.sqrt(2.6912 * 18.6875))
    assert out["cosine_mean"] == approx(0.24)


# --- registry -------------------------------------------------------------------------------

SMALL_INPUTS = {
    "classification": ([[0.7, 0.3], [0.4, 0.6]], [0, 1], {"labels": [0, 1]}),
    "regression": ([0.1, 0.5, 0.9], [0.0, 0.6, 1.0], {}),
    "token_classification": ([["B-PER", "O"]], [["B-PER", "O"]], {}),
    "question_answering": (["Paris"], [["Paris"]], {}),
    "seq2seq": (["a small cat"], ["a small cat"], {}),
    "causal_lm": (["the answer"], ["the answer"], {"nll_sum": 6.0, "token_count": 3}),
}


@pytest.mark.parametrize("task_type", DOWNSTREAM_TASK_TYPES)
def test_every_task_type_reports_its_primary_metric(task_type: str) -> None:
    predictions, references, opts = SMALL_INPUTS[task_type]
    out = compute_metrics(task_type, predictions, references, **opts)
    name, _ = primary_metric(task_type)
    assert name in out
    assert all(isinstance(value, float) for value in out.values())


def test_registry_keys_are_stable() -> None:
    keys = set(compute_metrics("classification", [0, 1, 1], [0, 1, 0], labels=[0, 1]))
    assert {"accuracy", "f1_macro", "f1_micro", "mcc"} <= keys
    assert set(compute_metrics("seq2seq", ["x"], ["x"])) == {
        "bleu",
        "chrf",
        "rouge1",
        "rouge2",
        "rougeL",
    }
    assert compute_metrics("causal_lm", [], [], nll_sum=0.0, token_count=4) == {"perplexity": 1.0}


def test_perplexity_is_the_only_primary_metric_where_lower_is_better() -> None:
    lower = [t for t in DOWNSTREAM_TASK_TYPES if not primary_metric(t)[1]]
    assert lower == ["causal_lm"]


def test_unknown_task_types_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown task type 'ranking'"):
        compute_metrics("ranking", [1], [1])
    with pytest.raises(ValueError, match="unknown task type"):
        primary_metric("ranking")
