"""The synthetic demo corpus: deterministic bytes, a world that tokenizes well, honest task splits."""

from __future__ import annotations

import csv
import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.synthetic import (
    RESIDENCE_QUESTIONS,
    SyntheticConfig,
    fact_sentence,
    grammar_sentence,
    make_world,
    person_splits,
    write_corpus,
)

SMALL = SyntheticConfig(documents=400, task_examples=50)


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def corpus_texts(out: Path) -> list[str]:
    texts = []
    for part in sorted((out / "corpus").glob("part-*.jsonl.gz")):
        with gzip.open(part, "rt") as handle:
            texts += [json.loads(line)["text"] for line in handle]
    return texts


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    write_corpus(out, SMALL)
    return out


def test_same_seed_writes_the_same_bytes(small_corpus: Path, tmp_path: Path) -> None:
    files = write_corpus(tmp_path, SMALL)
    for path in files:
        twin = small_corpus / path.relative_to(tmp_path)
        assert path.read_bytes() == twin.read_bytes(), path.name


def test_another_seed_writes_another_world_and_corpus(small_corpus: Path, tmp_path: Path) -> None:
    write_corpus(tmp_path, SMALL.model_copy(update={"seed": 1}))
    assert corpus_texts(tmp_path) != corpus_texts(small_corpus)
    assert make_world(SMALL) != make_world(SMALL.model_copy(update={"seed": 1}))


def test_world_names_are_distinct_single_words_outside_the_corpus_vocabulary() -> None:
    world = make_world(SyntheticConfig(people=600))
    names = [p.name for p in world]
    assert len(set(names)) == 600
    assert all(re.fullmatch(r"[A-Z][a-z]{4}", n) for n in names)
    other_words = {
        w.strip(".").lower()
        for p in world[:12]
        for kind in ("city", "job", "pet")
        for w in fact_sentence(p, kind).split()[1:]
    }
    assert not {n.lower() for n in names} & other_words


def test_every_city_has_the_same_number_of_people() -> None:
    counts = Counter(p.city for p in make_world(SyntheticConfig(people=240)))
    assert len(counts) == 12
    assert set(counts.values()) == {20}


def test_fact_tasks_never_share_a_person_between_splits(small_corpus: Path) -> None:
    for task in ("residence", "facts"):
        people: dict[str, set[str]] = {}
        for row in read_rows(small_corpus / "tasks" / f"{task}.csv"):
            name = next(w for w in row["sentence"].rstrip("?").split() if w[0].isupper()
                        and w not in ("Where", "In", "Which", "Is"))
            people.setdefault(row["split"], set()).add(name)
        assert set(people) == {"train", "validation", "test"}
        assert not people["train"] & people["test"], task
        assert not people["train"] & people["validation"], task
        assert not people["validation"] & people["test"], task


def test_residence_test_split_is_balanced_so_chance_is_one_in_twelve(small_corpus: Path) -> None:
    rows = read_rows(small_corpus / "tasks" / "residence.csv")
    test = Counter(r["label"] for r in rows if r["split"] == "test")
    assert len(test) == 12
    assert len(set(test.values())) == 1
    train = [r for r in rows if r["split"] == "train"]
    assert 0 < len(train) <= 500


def test_residence_answers_are_stated_in_the_corpus_but_never_asked_there(
    small_corpus: Path,
) -> None:
    text = "\n".join(corpus_texts(small_corpus))
    world = {p.name: p for p in make_world(SMALL)}
    splits = person_splits(list(world.values()), SMALL)
    test_people = [name for name, split in splits.items() if split == "test"]
    stated = [name for name in test_people if f"{name} lives in {world[name].city}." in text]
    assert len(stated) == len(test_people)
    assert "?" not in text
    assert not any(q.split("{")[0].strip() in text for q in RESIDENCE_QUESTIONS)


def test_residence_labels_are_the_true_cities(small_corpus: Path) -> None:
    world = {p.name: p for p in make_world(SMALL)}
    for row in read_rows(small_corpus / "tasks" / "residence.csv"):
        name = row["sentence"].rstrip("?").split()[-1 if "home" in row["sentence"] else -2]
        assert world[name].city == row["label"], row


def test_fact_claims_are_half_true_half_false_in_every_split(small_corpus: Path) -> None:
    rows = read_rows(small_corpus / "tasks" / "facts.csv")
    for split in ("train", "validation", "test"):
        labels = Counter(r["label"] for r in rows if r["split"] == split)
        assert labels["1"] == labels["0"] > 0, split


def test_acceptability_labels_follow_agreement(small_corpus: Path) -> None:
    rows = read_rows(small_corpus / "tasks" / "acceptability.csv")
    assert len(rows) == SMALL.task_examples
    singular = {"runs", "sings", "waits", "sleeps", "works", "shines", "moves", "rests"}
    plural_nouns = {"dogs", "children", "farmers", "birds", "teachers", "rivers", "trains", "cooks"}
    for row in rows:
        words = row["sentence"].split()
        noun, verb = words[2], words[3]
        agrees = (noun in plural_nouns) != (verb in singular)
        assert agrees == (row["label"] == "1"), row


def test_grammar_sentence_violates_agreement_only_when_asked() -> None:
    import random

    rng = random.Random(0)
    assert all(grammar_sentence(rng).startswith("The ") for _ in range(20))


def test_config_refuses_a_world_too_small_for_the_splits() -> None:
    with pytest.raises(ValidationError, match="people"):
        SyntheticConfig(people=10)
