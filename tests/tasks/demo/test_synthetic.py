"""The synthetic demo corpus: same seed same bytes, one-word names, person-disjoint task splits."""

from __future__ import annotations

import csv
import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.demo.synthetic import (
    KINDS,
    RESIDENCE_QUESTIONS,
    SyntheticConfig,
    fact_sentence,
    make_world,
    person_splits,
    write_corpus,
)
from tasks.tokenizer.tokenizer import TokenizerConfig, train_tokenizer

SMALL = SyntheticConfig(documents=400, task_examples=50)
SPLITS = ("train", "validation", "test")


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def corpus_texts(out: Path) -> list[str]:
    texts = []
    for part in sorted((out / "corpus").glob("part-*.jsonl.gz")):
        with gzip.open(part, "rt") as handle:
            texts += [json.loads(line)["text"] for line in handle]
    return texts


def person_in(sentence: str, names: set[str]) -> str:
    """The one world name a task sentence mentions."""
    found = [w for w in re.findall(r"[A-Za-z]+", sentence) if w in names]
    assert len(found) == 1, sentence
    return found[0]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    write_corpus(out, SMALL)
    return out


def test_same_seed_writes_the_same_bytes(small_corpus: Path, tmp_path: Path) -> None:
    files = write_corpus(tmp_path, SMALL)
    assert len(files) == SMALL.parts + 3
    for path in files:
        twin = small_corpus / path.relative_to(tmp_path)
        assert path.read_bytes() == twin.read_bytes(), path.name


def test_another_seed_writes_another_world_and_corpus(small_corpus: Path, tmp_path: Path) -> None:
    other = SMALL.model_copy(update={"seed": 1})
    write_corpus(tmp_path, other)
    assert corpus_texts(tmp_path) != corpus_texts(small_corpus)
    assert make_world(other) != make_world(SMALL)


def test_world_names_are_distinct_capitalised_words_unlike_any_other_corpus_word() -> None:
    world = make_world(SyntheticConfig(people=600))
    names = {p.name.lower() for p in world}
    assert len(names) == 600
    assert all(re.fullmatch(r"[A-Z][a-z]{4}", p.name) for p in world)
    other_words = {
        word.strip(".").lower()
        for person in world
        for kind in KINDS
        for word in fact_sentence(person, kind, form=1).split()[1:]
    }
    assert not names & other_words


def test_a_small_wordpiece_vocabulary_keeps_every_name_whole(small_corpus: Path) -> None:
    tokenizer = train_tokenizer(
        corpus_texts(small_corpus), TokenizerConfig(family="wordpiece", vocab_size=2048)
    )
    split = [p.name for p in make_world(SMALL) if len(tokenizer.encode(p.name).tokens) != 3]
    assert split == []  # [CLS] name [SEP]


def test_every_city_has_the_same_number_of_people() -> None:
    counts = Counter(p.city for p in make_world(SyntheticConfig(people=240)))
    assert len(counts) == 12
    assert set(counts.values()) == {20}


@pytest.mark.parametrize("task", ["residence", "facts"])
def test_fact_tasks_never_share_a_person_between_splits(small_corpus: Path, task: str) -> None:
    names = {p.name for p in make_world(SMALL)}
    people: dict[str, set[str]] = {split: set() for split in SPLITS}
    for row in read_rows(small_corpus / "tasks" / f"{task}.csv"):
        people[row["split"]].add(person_in(row["sentence"], names))
    assert all(people.values())
    assert not people["train"] & people["test"]
    assert not people["train"] & people["validation"]
    assert not people["validation"] & people["test"]


def test_residence_test_split_is_balanced_so_chance_is_one_in_twelve(small_corpus: Path) -> None:
    rows = read_rows(small_corpus / "tasks" / "residence.csv")
    test = Counter(r["label"] for r in rows if r["split"] == "test")
    assert len(test) == 12
    assert len(set(test.values())) == 1
    train = [r for r in rows if r["split"] == "train"]
    assert 0 < len(train) <= 500


def test_residence_labels_are_the_true_cities(small_corpus: Path) -> None:
    world = {p.name: p for p in make_world(SMALL)}
    rows = read_rows(small_corpus / "tasks" / "residence.csv")
    for row in rows:
        assert world[person_in(row["sentence"], set(world))].city == row["label"], row
    assert {r["sentence"].split()[0] for r in rows if r["split"] == "train"} == {
        q.split()[0] for q in RESIDENCE_QUESTIONS
    }


def test_test_people_cities_are_stated_in_the_corpus_and_never_asked_there(
    small_corpus: Path,
) -> None:
    text = "\n".join(corpus_texts(small_corpus))
    world = make_world(SMALL)
    test_people = [p for p in world if person_splits(world, SMALL)[p.name] == "test"]
    assert all(f"{p.name} lives in {p.city}." in text for p in test_people)
    assert "?" not in text
    assert not any(q.split("{")[0].strip() in text for q in RESIDENCE_QUESTIONS)


def test_fact_claims_are_half_true_half_false_in_every_split(small_corpus: Path) -> None:
    world = {p.name: p for p in make_world(SMALL)}
    rows = read_rows(small_corpus / "tasks" / "facts.csv")
    for split in SPLITS:
        labels = Counter(r["label"] for r in rows if r["split"] == split)
        assert labels["1"] == labels["0"] > 0, split
    for row in rows:
        person = world[person_in(row["sentence"], set(world))]
        true_values = {person.city, person.job, person.pet}
        stated = row["sentence"].rstrip("?").split()[-1]
        assert (stated in true_values) == (row["label"] == "1"), row


def test_acceptability_labels_follow_agreement(small_corpus: Path) -> None:
    rows = read_rows(small_corpus / "tasks" / "acceptability.csv")
    assert len(rows) == SMALL.task_examples
    singular_verbs = {"runs", "sings", "waits", "sleeps", "works", "shines", "moves", "rests"}
    plural_nouns = {"dogs", "children", "farmers", "birds", "teachers", "rivers", "trains", "cooks"}
    for row in rows:
        noun, verb = row["sentence"].split()[2:4]
        agrees = (noun in plural_nouns) != (verb in singular_verbs)
        assert agrees == (row["label"] == "1"), row


def test_config_refuses_a_world_too_small_for_the_splits() -> None:
    with pytest.raises(ValidationError, match="people"):
        SyntheticConfig(people=10)
    with pytest.raises(ValidationError, match="no train person per city"):
        SyntheticConfig(people=48, test_share=0.5, validation_share=0.4)
    assert SyntheticConfig(people=36).people == 36  # 3 per city: one per split
