import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tasks.common import schema
from tasks.decontaminate.decontaminate import (
    CONTAMINATED_BY,
    DecontaminateConfig,
    EvalTask,
    decontaminate,
    decontamination_report,
    eval_ngrams,
    eval_texts,
    load_eval_ngrams,
    ngram_hashes,
    normalized_words,
)
from tasks.demo.synthetic import SyntheticConfig, write_corpus

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "tasks"

TEST_SENTENCE = (
    "The committee agreed that the new bridge across the northern river would open "
    "to traffic early next spring after final safety inspections"
)  # 22 words


def documents(texts: list[str]) -> pa.Table:
    n = len(texts)
    return pa.table(
        {
            schema.DOC_ID: [f"d{i}" for i in range(n)],
            schema.SOURCE: ["s"] * n,
            schema.SOURCE_FILE: ["f"] * n,
            schema.OFFSET: pa.array(range(n), pa.int64()),
            schema.LINE: pa.array([None] * n, pa.int64()),
            schema.TEXT: pa.array(texts, pa.large_string()),
            schema.SENTENCES: [[t] for t in texts],
        },
        schema=schema.DOCUMENTS,
    )


FILLER = [
    f"Document {i} talks about gardening, weather and the price of bread in town {i}."
    for i in range(40)
]


def test_words_are_lowercased_and_stripped_of_punctuation() -> None:
    words = normalized_words(pa.array(["  Don't STOP—me now!! ", "", "Ünïcode café, 2024."]))
    assert words.to_pylist() == [["don", "t", "stop", "me", "now"], [], ["ünïcode", "café", "2024"]]


def test_each_text_yields_words_minus_n_plus_one_ngrams_and_none_across_texts() -> None:
    hashes, text = ngram_hashes(pa.array(["a b c d", "e f", "g h i"]), 3)
    assert text.tolist() == [0, 0, 2]
    assert len(set(hashes.tolist())) == 3


def test_planted_13_gram_removes_exactly_that_document() -> None:
    words = TEST_SENTENCE.split()
    planted = "Yesterday, " + " ".join(words[4:17]) + " -- said nobody."
    corpus = documents([*FILLER[:20], planted, *FILLER[20:]])
    ngrams = {"task/test": eval_ngrams(pa.array([TEST_SENTENCE]), 13)}
    kept, removed = decontaminate(corpus, ngrams, 13)
    assert removed.column(schema.TEXT).to_pylist() == [planted]
    assert removed.column(CONTAMINATED_BY).to_pylist() == [["task/test"]]
    assert kept.schema == corpus.schema
    assert kept.num_rows + removed.num_rows == corpus.num_rows
    report = decontamination_report(kept, removed, ngrams, 13)
    assert (report.documents_read, report.documents_kept, report.documents_removed) == (41, 40, 1)
    assert report.removed_by == {"task/test": 1}
    assert report.eval_ngrams == {"task/test": 22 - 13 + 1}


def test_case_and_punctuation_do_not_hide_an_overlap() -> None:
    words = TEST_SENTENCE.split()
    shouted = ", ".join(w.upper() for w in words[:13]) + "!!!"
    kept, removed = decontaminate(
        documents([shouted, *FILLER[:3]]), {"t": eval_ngrams(pa.array([TEST_SENTENCE]), 13)}, 13
    )
    assert removed.num_rows == 1
    assert kept.num_rows == 3


def test_an_overlap_shorter_than_n_words_is_kept() -> None:
    twelve = " ".join(TEST_SENTENCE.split()[:12])
    kept, removed = decontaminate(
        documents([twelve]), {"t": eval_ngrams(pa.array([TEST_SENTENCE]), 13)}, 13
    )
    assert (kept.num_rows, removed.num_rows) == (1, 0)


def test_an_overlap_split_across_two_documents_is_not_a_match() -> None:
    words = TEST_SENTENCE.split()
    corpus = documents([" ".join(words[:7]), " ".join(words[7:14])])
    _, removed = decontaminate(corpus, {"t": eval_ngrams(pa.array([TEST_SENTENCE]), 13)}, 13)
    assert removed.num_rows == 0


def test_removed_documents_name_every_eval_set_they_overlap() -> None:
    other = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    ngrams = {
        "a/validation": eval_ngrams(pa.array([TEST_SENTENCE]), 13),
        "b/test": eval_ngrams(pa.array([other, TEST_SENTENCE]), 13),
        "c/test": eval_ngrams(pa.array(["nothing in common with anything at all here"]), 13),
    }
    corpus = documents([TEST_SENTENCE, other, FILLER[0]])
    kept, removed = decontaminate(corpus, ngrams, 13)
    assert removed.column(CONTAMINATED_BY).to_pylist() == [["a/validation", "b/test"], ["b/test"]]
    report = decontamination_report(kept, removed, ngrams, 13)
    assert report.removed_by == {"a/validation": 1, "b/test": 2, "c/test": 0}
    assert report.merged(report).documents_read == 6


def test_unsorted_ngrams_are_refused() -> None:
    with pytest.raises(ValueError, match="sorted and distinct"):
        decontaminate(documents(["x"]), {"t": np.array([5, 1], dtype=np.uint64)}, 13)


def test_eval_texts_cover_every_text_column_and_joined_tokens() -> None:
    qa = pa.table({"question": ["Where?"], "context": ["In Paris."], "example_id": ["1"]})
    assert eval_texts(qa).to_pylist() == ["Where?", "In Paris."]
    ner = pa.table({"tokens": [["Angela", "Merkel"]], "tags": [[1, 2]]})
    assert eval_texts(ner).to_pylist() == ["Angela Merkel"]


def test_eval_ngrams_load_from_task_configs(shared_data: Path) -> None:
    cfg = DecontaminateConfig(
        enabled=True, tasks=[EvalTask(config=CONFIGS / "wmt_en_ro.yaml", base_dir=shared_data)]
    )
    ngrams = load_eval_ngrams(cfg)
    assert sorted(ngrams) == ["wmt_en_ro/test", "wmt_en_ro/validation"]
    assert all(len(g) > 100 for g in ngrams.values())


def corpus_texts(out: Path) -> list[str]:
    texts = []
    for part in sorted((out / "corpus").glob("*.jsonl.gz")):
        with gzip.open(part, "rt") as handle:
            texts += [json.loads(line)["text"] for line in handle]
    return texts


def test_demo_corpus_loses_only_the_planted_document(tmp_path: Path) -> None:
    write_corpus(tmp_path, SyntheticConfig())
    texts = corpus_texts(tmp_path)
    planted = texts[:]
    planted[7] = planted[7] + " " + TEST_SENTENCE
    corpus = documents(planted)
    ngrams = {"t": eval_ngrams(pa.array([TEST_SENTENCE] * 200), 13)}
    kept, removed = decontaminate(corpus, ngrams, 13)
    assert len(ngrams["t"]) == 22 - 13 + 1  # 200 copies searched as their distinct 13-grams
    assert corpus.num_rows >= 3000
    assert removed.column(schema.DOC_ID).to_pylist() == ["d7"]
    assert kept.num_rows == corpus.num_rows - 1
