import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tasks.common import schema
from tasks.demo.synthetic import SyntheticConfig, write_corpus
from tasks.downstream.config import DatasetConfigError
from tasks.downstream.downstream import (
    DatasetConfig,
    DownstreamData,
    DownstreamDataError,
    load_dataset_config,
    load_downstream,
)
from tasks.downstream.stage import (
    prepare_downstream,
    prepare_downstream_task,
    read_downstream,
    read_downstream_dir,
)

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "tasks"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def config(**values: Any) -> DatasetConfig:
    return DatasetConfig.model_validate({"name": "t", **values})


def load_real(name: str, base: Path) -> DownstreamData:
    data = load_downstream(load_dataset_config(CONFIGS / f"{name}.yaml"), base)
    for table in data.splits.values():
        assert table.schema == schema.downstream_schema(data.task_type, data.pair)
    return data


def rows(data: DownstreamData) -> dict[str, int]:
    return {split: table.num_rows for split, table in data.splits.items()}


def first(data: DownstreamData, split: str = "train") -> dict[str, Any]:
    row: dict[str, Any] = data.splits[split].slice(0, 1).to_pylist()[0]
    return row


def label_sum(data: DownstreamData, split: str) -> int:
    return int(pc.sum(data.splits[split].column(schema.LABEL)).as_py())


# Real public sets in ../shared/data, each read through its configs/tasks/*.yaml alone.
SHARED_SETS = [
    "imdb",
    "cola",
    "mrpc",
    "mrpc_sample",
    "stsb",
    "squad",
    "conll",
    "germeval",
    "xsum",
    "wmt16",
    "wmt_en_ro",
    "instructions",
]
DEMO_SETS = ["demo_facts", "demo_residence"]


def test_every_task_config_is_covered_by_a_real_data_test() -> None:
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == {*SHARED_SETS, *DEMO_SETS}


def test_imdb_csv_splits_by_its_is_valid_flag(shared_data: Path) -> None:
    data = load_real("imdb", shared_data)
    assert rows(data) == {"train": 800, "validation": 200}
    assert data.labels == ("negative", "positive")
    assert label_sum(data, "train") + label_sum(data, "validation") == 476  # positives
    row = first(data)
    assert row["text"].startswith("Un-bleeping-believable! Meg Ryan")
    assert row["label"] == 0


def test_cola_headerless_tsvs_load_by_column_position(shared_data: Path) -> None:
    data = load_real("cola", shared_data)
    assert rows(data) == {"train": 8551, "validation": 527, "test": 516}
    assert [label_sum(data, s) for s in ("train", "validation", "test")] == [6023, 365, 354]
    assert first(data)["text"] == (
        "Our friends won't buy this analysis, let alone the next one we propose."
    )


def test_glue_mrpc_pairs_keep_their_stray_quotes(shared_data: Path) -> None:
    data = load_real("mrpc", shared_data)
    assert data.pair
    assert rows(data) == {"train": 3668, "validation": 408}
    assert [label_sum(data, "train"), label_sum(data, "validation")] == [2474, 279]
    row = first(data)
    assert row["text"] == (
        'Amrozi accused his brother, whom he called "the witness", of deliberately distorting '
        "his evidence."
    )
    assert row["label"] == 1


def test_mrpc_sample_csv_unescapes_doubled_quotes(shared_data: Path) -> None:
    data = load_real("mrpc_sample", shared_data)
    assert rows(data) == {"train": 6, "validation": 6}
    row = first(data)
    assert row["text_pair"] == (
        '" The foodservice pie business does not fit our long-term growth strategy .'
    )
    assert data.labels[row["label"]] == "equivalent"


def test_stsb_scores_are_float_labels(shared_data: Path) -> None:
    data = load_real("stsb", shared_data)
    assert rows(data) == {"train": 9, "validation": 9}
    row = first(data)
    assert (row["text"], row["text_pair"], row["label"]) == (
        "A plane is taking off.",
        "An air plane is taking off.",
        5.0,
    )


def test_squad_sample_keeps_ids_answers_and_unanswerable_questions(shared_data: Path) -> None:
    data = load_real("squad", shared_data)
    assert rows(data) == {"train": 14, "validation": 14}
    table = data.splits["train"]
    unanswerable = pc.sum(pc.equal(pc.list_value_length(table.column(schema.ANSWER_TEXTS)), 0))
    assert unanswerable.as_py() == 6
    row = first(data)
    assert row["example_id"] == "56ddde6b9a695914005b9628"
    assert row["answer_texts"][0] == "France"
    assert row["context"][row["answer_starts"][0] :].startswith("France")


def test_conll_jsonl_tags_become_label_ids(shared_data: Path) -> None:
    data = load_real("conll", shared_data)
    assert rows(data) == {"train": 10, "validation": 10}
    row = first(data)
    assert row["tokens"][8] == "Angels"
    assert data.labels[row["tags"][8]] == "B-ORG"
    assert len(row["tokens"]) == len(row["tags"]) == 17


def test_germeval_token_per_line_text_reads_as_sentences(shared_data: Path) -> None:
    data = load_real("germeval", shared_data)
    assert rows(data) == {"train": 11, "validation": 11}
    assert len(data.labels) == 25
    row = first(data)
    assert row["tokens"][:2] == ["Schartau", "sagte"]
    assert [data.labels[t] for t in row["tags"][:2]] == ["B-PER", "O"]


def test_xsum_documents_keep_their_newlines(shared_data: Path) -> None:
    data = load_real("xsum", shared_data)
    assert rows(data) == {"train": 10, "validation": 10}
    row = first(data)
    assert "\n" in row["text"]
    assert row["target"].startswith("The Met Office has issued a yellow weather warning")


def test_wmt16_reads_nested_translation_fields(shared_data: Path) -> None:
    data = load_real("wmt16", shared_data)
    assert rows(data) == {"train": 10, "validation": 10}
    row = first(data)
    assert row["text"] == "Membership of Parliament: see Minutes"
    assert row["target"] == "Componenţa Parlamentului: a se vedea procesul-verbal"


def test_wmt_en_ro_has_three_split_files(shared_data: Path) -> None:
    assert rows(load_real("wmt_en_ro", shared_data)) == {"train": 11, "validation": 16, "test": 20}


def test_instruction_data_splits_in_file_order_with_the_book_template(shared_data: Path) -> None:
    data = load_real("instructions", shared_data)
    assert rows(data) == {"train": 935, "test": 110, "validation": 55}
    row = first(data)
    assert row["prompt"].startswith("Below is an instruction that describes a task.")
    assert row["prompt"].endswith(
        "### Instruction:\nEvaluate the following phrase by transforming it into the spelling "
        "given.\n\n### Input:\nfreind --> friend\n\n### Response:\n"
    )
    assert row["response"].startswith('The spelling of the given phrase "freind" is incorrect')
    prompts = [p for t in data.splits.values() for p in t.column(schema.PROMPT).to_pylist()]
    assert sum("### Input:" not in p for p in prompts) == 775  # records with an empty input
    third = data.splits["train"].slice(2, 1).to_pylist()[0]
    assert third["prompt"].endswith(
        "### Instruction:\nConvert 45 kilometers to meters.\n\n### Response:\n"
    )


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    write_corpus(out, SyntheticConfig(documents=50, parts=1))
    return out


@pytest.mark.parametrize("name", DEMO_SETS)
def test_demo_tasks_load_from_the_synthetic_csv(demo_data: Path, name: str) -> None:
    cfg = load_dataset_config(CONFIGS / f"{name}.yaml")
    data = load_real(name, demo_data)
    assert cfg.path is not None
    with open(demo_data / cfg.path, newline="") as handle:
        records = list(csv.DictReader(handle))
    split_sizes = Counter(r["split"] for r in records)
    expected = {s: min(n, cfg.max_examples.get(s, n)) for s, n in split_sizes.items()}
    assert rows(data) == expected
    assert data.labels == tuple(
        cfg.labels or sorted({r["label"] for r in records if r["split"] == "train"})
    )
    row = first(data)
    train = [r for r in records if r["split"] == "train"]
    assert (row["text"], data.labels[row["label"]]) == (train[0]["sentence"], train[0]["label"])


# Refusals: each names the file, the column and the line (or row, or record).


def test_missing_csv_column_names_the_file_and_column(tmp_path: Path) -> None:
    write(tmp_path / "train.csv", "sentence,label\nhello,0\n")
    cfg = config(
        task_type="classification",
        splits={"train": "train.csv"},
        columns={"text": "text", "label": "label"},
        labels=["0", "1"],
    )
    with pytest.raises(
        DownstreamDataError, match=r"train\.csv: no column 'text'.*\['sentence', 'label'\]"
    ):
        load_downstream(cfg, tmp_path)


def test_unknown_label_names_the_file_line_and_value(tmp_path: Path) -> None:
    write(tmp_path / "train.csv", "text,label\ngood film,positive\nodd film,maybe\n")
    cfg = config(
        task_type="classification",
        splits={"train": "train.csv"},
        columns={"text": "text", "label": "label"},
        labels=["negative", "positive"],
    )
    with pytest.raises(
        DownstreamDataError, match=r"train\.csv: line 3: column 'label'.*unknown label 'maybe'"
    ):
        load_downstream(cfg, tmp_path)


def test_empty_split_names_the_file_and_split(tmp_path: Path) -> None:
    write(tmp_path / "train.csv", "text,label\ngood,1\n")
    write(tmp_path / "dev.csv", "text,label\n")
    cfg = config(
        task_type="classification",
        splits={"train": "train.csv", "validation": "dev.csv"},
        columns={"text": "text", "label": "label"},
    )
    with pytest.raises(DownstreamDataError, match=r"dev\.csv: split 'validation' of t is empty"):
        load_downstream(cfg, tmp_path)


def test_malformed_jsonl_line_is_refused_with_its_line_number(tmp_path: Path) -> None:
    write(tmp_path / "train.jsonl", '{"a": "x", "b": "y"}\n\n{"a": "x", "b": \n')
    cfg = config(
        task_type="seq2seq", splits={"train": "train.jsonl"}, columns={"text": "a", "target": "b"}
    )
    with pytest.raises(DownstreamDataError, match=r"train\.jsonl: line 3: invalid JSON"):
        load_downstream(cfg, tmp_path)


def test_json_record_without_a_key_names_the_record_and_column(tmp_path: Path) -> None:
    write(tmp_path / "d.json", json.dumps([{"a": "x", "b": "y"}, {"a": "x"}]))
    cfg = config(
        task_type="seq2seq", splits={"train": "d.json"}, columns={"text": "a", "target": "b"}
    )
    with pytest.raises(
        DownstreamDataError, match=r"d\.json: record 2: column 'target' \(field 'b'\).*missing"
    ):
        load_downstream(cfg, tmp_path)


def test_headerless_row_with_too_few_fields_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "t.tsv", "s1\t1\t\tA fine sentence.\ns2\t0\tBroken line\n")
    cfg = config(
        task_type="classification",
        header=False,
        splits={"train": "t.tsv"},
        columns={"label": 1, "text": 3},
        labels=["0", "1"],
    )
    with pytest.raises(DownstreamDataError, match=r"t\.tsv: line 2: expected 4 fields, found 3"):
        load_downstream(cfg, tmp_path)


def test_tsv_reads_quotes_literally_and_csv_locates_multiline_records(tmp_path: Path) -> None:
    write(tmp_path / "q.tsv", 'text\tlabel\nHe said " hi\t1\n')
    cfg = config(
        task_type="classification",
        splits={"train": "q.tsv"},
        columns={"text": "text", "label": "label"},
    )
    assert first(load_downstream(cfg, tmp_path))["text"] == 'He said " hi'
    write(tmp_path / "m.csv", 'text,label\n"two\nlines",1\n"bad",x\n')
    cfg = config(
        task_type="classification",
        splits={"train": "m.csv"},
        columns={"text": "text", "label": "label"},
        labels=["1"],
    )
    with pytest.raises(DownstreamDataError, match=r"m\.csv: line 4: .*unknown label 'x'"):
        load_downstream(cfg, tmp_path)


def test_non_numeric_regression_score_is_refused_with_its_value(tmp_path: Path) -> None:
    write(tmp_path / "s.tsv", "a\tb\tscore\nx\ty\t4.5\nx\ty\thigh\n")
    cfg = config(
        task_type="regression",
        splits={"train": "s.tsv"},
        columns={"text": "a", "text_pair": "b", "label": "score"},
    )
    with pytest.raises(DownstreamDataError, match=r"s\.tsv: line 3: column 'label'.*'high'"):
        load_downstream(cfg, tmp_path)


def test_tokens_and_tags_of_different_lengths_are_refused(tmp_path: Path) -> None:
    write(
        tmp_path / "n.jsonl", '{"w": ["a", "b"], "t": ["O", "O"]}\n{"w": ["a", "b"], "t": ["O"]}\n'
    )
    cfg = config(
        task_type="token_classification",
        format="jsonl",
        splits={"train": "n.jsonl"},
        columns={"tokens": "w", "tags": "t"},
    )
    with pytest.raises(DownstreamDataError, match=r"n\.jsonl: line 2: 2 tokens but 1 tags"):
        load_downstream(cfg, tmp_path)


def test_conll_line_without_a_tag_names_its_line(tmp_path: Path) -> None:
    write(tmp_path / "g.txt", "-DOCSTART- O\n\nBerlin B-LOC\nist O\n\nda\n")
    cfg = config(
        task_type="token_classification",
        format="conll",
        splits={"train": "g.txt"},
        columns={"tokens": 0, "tags": 1},
    )
    with pytest.raises(DownstreamDataError, match=r"g\.txt: line 6: line 6 has 1 field"):
        load_downstream(cfg, tmp_path)


def test_answer_not_at_its_offset_is_refused(tmp_path: Path) -> None:
    record = {"q": "Where?", "c": "In Paris.", "a": {"text": ["Paris"], "answer_start": [2]}}
    write(tmp_path / "qa.jsonl", json.dumps(record) + "\n")
    cfg = config(
        task_type="question_answering",
        format="jsonl",
        splits={"train": "qa.jsonl"},
        columns={"question": "q", "context": "c", "answers": "a"},
    )
    with pytest.raises(
        DownstreamDataError, match=r"qa\.jsonl: line 1: .*'Paris' is not at answer_start 2"
    ):
        load_downstream(cfg, tmp_path)


def test_repeated_example_id_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "d.csv", "id,text,label\n7,a,0\n7,b,1\n")
    cfg = config(
        task_type="classification",
        splits={"train": "d.csv"},
        columns={"example_id": "id", "text": "text", "label": "label"},
    )
    with pytest.raises(
        DownstreamDataError, match=r"d\.csv: line 3: column 'example_id'.*repeats '7'"
    ):
        load_downstream(cfg, tmp_path)


def test_skip_policy_drops_bad_records_and_counts_reconcile(tmp_path: Path) -> None:
    write(tmp_path / "d.csv", "text,label\na,0\nb,2\n,1\nc,1\nd\ne,0\n")
    cfg = config(
        task_type="classification",
        splits={"train": "d.csv"},
        columns={"text": "text", "label": "label"},
        labels=["0", "1"],
        on_bad_row="skip",
        max_examples={"train": 2},
    )
    data = load_downstream(cfg, tmp_path)
    counts = data.counts["train"]
    assert (counts.read, counts.refused, counts.dropped, counts.kept) == (6, 3, 1, 2)
    assert counts.read == counts.refused + counts.dropped + counts.kept
    assert data.splits["train"].column("text").to_pylist() == ["a", "c"]


def test_derived_labels_are_sorted_and_unseen_validation_labels_refused(tmp_path: Path) -> None:
    write(tmp_path / "tr.csv", "text,label\na,pos\nb,neg\nc,neu\n")
    write(tmp_path / "va.csv", "text,label\nd,neg\ne,angry\n")
    cfg = config(
        task_type="classification",
        splits={"train": "tr.csv"},
        columns={"text": "text", "label": "label"},
    )
    data = load_downstream(cfg, tmp_path)
    assert data.labels == ("neg", "neu", "pos")
    assert data.splits["train"].column("label").to_pylist() == [2, 0, 1]
    both = cfg.model_copy(update={"splits": {"train": "tr.csv", "validation": "va.csv"}})
    with pytest.raises(DownstreamDataError, match=r"va\.csv: line 3: .*unknown label 'angry'"):
        load_downstream(both, tmp_path)


def test_max_examples_takes_the_head_or_a_seeded_sample(tmp_path: Path) -> None:
    lines = "".join(f"t{i},{i % 2}\n" for i in range(50))
    write(tmp_path / "d.csv", "text,label\n" + lines)
    head = config(
        task_type="classification",
        splits={"train": "d.csv"},
        columns={"text": "text", "label": "label"},
        max_examples={"train": 5},
    )
    assert load_downstream(head, tmp_path).splits["train"].column("text").to_pylist() == [
        f"t{i}" for i in range(5)
    ]
    seeded = head.model_copy(update={"sample_seed": 3})
    picks = [
        load_downstream(seeded, tmp_path).splits["train"].column("example_id").to_pylist()
        for _ in range(2)
    ]
    assert picks[0] == picks[1]
    assert picks[0] != [f"train-{i}" for i in range(5)]
    assert picks[0] == sorted(picks[0], key=lambda x: int(x.split("-")[1]))


def test_split_fractions_cut_in_file_order_with_the_rest_last(tmp_path: Path) -> None:
    write(tmp_path / "d.json", json.dumps([{"p": f"q{i}", "r": f"a{i}"} for i in range(11)]))
    cfg = config(
        task_type="causal_lm",
        path="d.json",
        split_fractions={"train": 0.5, "test": 0.3, "validation": 0.2},
        columns={"prompt": "p", "response": "r"},
    )
    data = load_downstream(cfg, tmp_path)
    assert rows(data) == {"train": 5, "test": 3, "validation": 3}
    assert data.splits["test"].column("prompt").to_pylist() == ["q5", "q6", "q7"]


def test_unknown_split_value_names_the_row_and_value(tmp_path: Path) -> None:
    write(tmp_path / "d.csv", "text,label,part\na,0,tr\nb,1,dev\n")
    cfg = config(
        task_type="classification",
        path="d.csv",
        split_column="part",
        split_values={"tr": "train"},
        columns={"text": "text", "label": "label"},
    )
    with pytest.raises(DownstreamDataError, match=r"d\.csv: line 3: split_column 'part' is 'dev'"):
        load_downstream(cfg, tmp_path)


def test_squad_nesting_reads_with_records_path_and_inherited_fields(tmp_path: Path) -> None:
    squad = {
        "version": "v2.0",
        "data": [
            {
                "title": "Paris",
                "paragraphs": [
                    {
                        "context": "Paris is in France.",
                        "qas": [
                            {
                                "id": "q1",
                                "question": "Where is Paris?",
                                "answers": [{"text": "France", "answer_start": 12}],
                            },
                            {"id": "q2", "question": "Who?", "answers": [], "is_impossible": True},
                        ],
                    }
                ],
            }
        ],
    }
    write(tmp_path / "squad.json", json.dumps(squad))
    cfg = config(
        task_type="question_answering",
        records_path="data.paragraphs.qas",
        splits={"validation": "squad.json"},
        columns={
            "example_id": "id",
            "question": "question",
            "context": "context",
            "answers": "answers",
        },
    )
    table = load_downstream(cfg, tmp_path).splits["validation"]
    assert table.to_pylist() == [
        {
            "example_id": "q1",
            "question": "Where is Paris?",
            "context": "Paris is in France.",
            "answer_texts": ["France"],
            "answer_starts": [12],
        },
        {
            "example_id": "q2",
            "question": "Who?",
            "context": "Paris is in France.",
            "answer_texts": [],
            "answer_starts": [],
        },
    ]


def test_parquet_columns_resolve_dotted_paths_into_structs(tmp_path: Path) -> None:
    table = pa.table({"translation": [{"en": "Hello", "de": "Hallo"}, {"en": "Yes", "de": "Ja"}]})
    pq.write_table(table, tmp_path / "t.parquet")
    cfg = config(
        task_type="seq2seq",
        splits={"train": "t.parquet"},
        columns={"text": "translation.en", "target": "translation.de"},
    )
    data = load_downstream(cfg, tmp_path)
    assert data.splits["train"].column("target").to_pylist() == ["Hallo", "Ja"]
    bad = cfg.model_copy(update={"columns": {"text": "translation.en", "target": "translation.fr"}})
    with pytest.raises(DownstreamDataError, match=r"t\.parquet: no column 'translation\.fr'"):
        load_downstream(bad, tmp_path)


@pytest.mark.slow
def test_saved_dataset_dict_brings_its_own_splits(tmp_path: Path) -> None:
    import datasets

    parts = {
        "train": datasets.Dataset.from_dict({"s": ["a", "b", "c"], "y": [0, 1, 1]}),
        "test": datasets.Dataset.from_dict({"s": ["d"], "y": [0]}),
    }
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "saved"))
    cfg = config(
        task_type="classification",
        format="hf_disk",
        path="saved",
        columns={"text": "s", "label": "y"},
    )
    data = load_downstream(cfg, tmp_path)
    assert rows(data) == {"train": 3, "test": 1}
    assert data.labels == ("0", "1")
    assert data.splits["train"].column("label").to_pylist() == [0, 1, 1]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"task_type": "classification", "splits": {"train": "a.csv"}, "columns": {"text": "s"}},
            "needs columns \\['label'\\]",
        ),
        (
            {
                "task_type": "classification",
                "path": "a.csv",
                "splits": {"train": "a.csv"},
                "columns": {"text": "s", "label": "y"},
            },
            "either `splits`",
        ),
        (
            {
                "task_type": "regression",
                "splits": {"train": "a.csv"},
                "columns": {"text": "s", "label": "y"},
                "labels": ["a"],
            },
            "labels belong",
        ),
        (
            {
                "task_type": "seq2seq",
                "splits": {"train": "a.csv"},
                "columns": {"text": "s", "target": "t", "tags": "x"},
            },
            "do not belong",
        ),
        (
            {
                "task_type": "classification",
                "header": False,
                "splits": {"train": "a.csv"},
                "columns": {"text": "s", "label": 1},
            },
            "header: false",
        ),
        (
            {
                "task_type": "causal_lm",
                "path": "a.json",
                "split_fractions": {"train": 0.5, "test": 0.4},
                "columns": {"prompt": "p", "response": "r"},
            },
            "sum to 1",
        ),
        (
            {
                "task_type": "causal_lm",
                "splits": {"train": "a.json"},
                "prompt_template": {"text": "{a!r}"},
                "columns": {"response": "r"},
            },
            "plain field name",
        ),
        (
            {
                "task_type": "seq2seq",
                "splits": {"../x": "a.csv"},
                "columns": {"text": "s", "target": "t"},
            },
            "split name",
        ),
    ],
)
def test_invalid_configs_are_refused_with_the_reason(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**values)


def test_task_yaml_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = write(
        tmp_path / "bad.yaml", "name: x\ntask_type: seq2seq\nsplits: {train: a.jsonl}\ncolums: {}\n"
    )
    with pytest.raises(DatasetConfigError, match=r"bad\.yaml: colums: Extra inputs"):
        load_dataset_config(path)


# The stage: prepared once, re-run is a no-op, read back with json + pyarrow only.


def small_task(tmp_path: Path) -> DatasetConfig:
    write(tmp_path / "src" / "train.csv", "text,label\na,0\nb,1\nc,1\n")
    write(tmp_path / "src" / "dev.csv", "text,label\nd,0\n")
    return config(
        task_type="classification",
        splits={"train": "train.csv", "validation": "dev.csv"},
        columns={"text": "text", "label": "label"},
    )


def test_prepare_downstream_rerun_is_a_no_op(tmp_path: Path) -> None:
    cfg = small_task(tmp_path)
    out = tmp_path / "out"
    manifest = prepare_downstream(cfg, tmp_path / "src", out)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare_downstream(cfg, tmp_path / "src", out) == manifest
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert sorted(stamps) == ["manifest.json", "train.arrow", "validation.arrow"]
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["task_type"] == "classification"
    assert on_disk["labels"] == ["0", "1"]
    assert on_disk["pair"] is False
    assert {s: e["rows"] for s, e in on_disk["splits"].items()} == {"train": 3, "validation": 1}


def test_prepare_downstream_rebuilds_when_an_input_or_the_config_changes(tmp_path: Path) -> None:
    cfg = small_task(tmp_path)
    out = tmp_path / "out"
    one = prepare_downstream(cfg, tmp_path / "src", out)
    write(tmp_path / "src" / "dev.csv", "text,label\nd,0\ne,1\n")
    two = prepare_downstream(cfg, tmp_path / "src", out)
    three = prepare_downstream(
        cfg.model_copy(update={"max_examples": {"train": 1}}), tmp_path / "src", out
    )
    assert len({one.fingerprint, two.fingerprint, three.fingerprint}) == 3
    assert read_downstream(out).counts["train"].kept == 1


def test_read_downstream_returns_the_loaded_tables(tmp_path: Path) -> None:
    cfg = small_task(tmp_path)
    manifest = prepare_downstream(cfg, tmp_path / "src", tmp_path / "out")
    loaded = load_downstream(cfg, tmp_path / "src")
    back = read_downstream(manifest)
    assert back.labels == loaded.labels
    assert back.counts == loaded.counts
    assert all(back.splits[s].equals(loaded.splits[s]) for s in loaded.splits)
    with pytest.raises(FileNotFoundError, match="no prepared downstream data"):
        read_downstream_dir(tmp_path / "src")


def test_prepare_downstream_task_returns_the_manifest_and_whether_it_was_reused(
    tmp_path: Path,
) -> None:
    from prefect.logging import disable_run_logger

    cfg = small_task(tmp_path)
    with disable_run_logger():
        first = prepare_downstream_task.fn(cfg, str(tmp_path / "src"), str(tmp_path / "out"))
        second = prepare_downstream_task.fn(cfg, str(tmp_path / "src"), str(tmp_path / "out"))
    manifest = prepare_downstream(cfg, tmp_path / "src", tmp_path / "out").model_dump(mode="json")
    assert first == manifest | {"reused": False}
    assert second == manifest | {"reused": True}
