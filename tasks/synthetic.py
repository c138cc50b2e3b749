"""A deterministic synthetic corpus with learnable structure, and labelled tasks drawn from it.

The world: people with a home city, a profession and a pet (facts that recur across many
documents), and a grammar of sentences with subject-verb agreement. Documents are biographies and
short stories of several sentences. The downstream tasks are fact verification (is the statement
true of the world?) and acceptability (is the agreement right?). Same seed, same bytes.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tasks.io import atomic_writer

_FIRST = [
    "Alice",
    "Bruno",
    "Clara",
    "Daniel",
    "Elena",
    "Felix",
    "Greta",
    "Hugo",
    "Irene",
    "Jonas",
    "Katrin",
    "Leon",
    "Mara",
    "Nils",
    "Olga",
    "Pavel",
    "Quinn",
    "Rosa",
    "Stefan",
    "Tara",
    "Ulrich",
    "Vera",
    "Walter",
    "Xenia",
    "Yusuf",
    "Zora",
    "Anton",
    "Berta",
    "Carlo",
    "Dora",
]
_LAST = [
    "Adler",
    "Berg",
    "Costa",
    "Dahl",
    "Eckert",
    "Fischer",
    "Gray",
    "Holm",
    "Ivanov",
    "Jensen",
    "Keller",
    "Lund",
    "Moreau",
    "Novak",
    "Ortega",
    "Petrov",
    "Quist",
    "Rossi",
    "Sauer",
    "Thorne",
]
_CITIES = [
    "Paris",
    "Lisbon",
    "Oslo",
    "Vienna",
    "Prague",
    "Dublin",
    "Madrid",
    "Warsaw",
    "Athens",
    "Zurich",
    "Riga",
    "Bergen",
]
_JOBS = [
    "doctor",
    "baker",
    "pilot",
    "teacher",
    "farmer",
    "painter",
    "lawyer",
    "sailor",
    "chemist",
    "carpenter",
]
_PETS = ["cat", "dog", "parrot", "horse", "rabbit", "tortoise", "goat", "hamster"]
_NOUNS = [
    ("dog", "dogs"),
    ("child", "children"),
    ("farmer", "farmers"),
    ("bird", "birds"),
    ("teacher", "teachers"),
    ("river", "rivers"),
    ("train", "trains"),
    ("cook", "cooks"),
]
_VERBS = [
    ("runs", "run"),
    ("sings", "sing"),
    ("waits", "wait"),
    ("sleeps", "sleep"),
    ("works", "work"),
    ("shines", "shine"),
    ("moves", "move"),
    ("rests", "rest"),
]
_ADJS = ["old", "young", "quiet", "busy", "small", "tall", "happy", "tired"]
_PLACES = [
    "near the market",
    "by the old bridge",
    "in the morning",
    "after the rain",
    "under the trees",
]


class SyntheticConfig(BaseModel):
    """Size and seed of the synthetic demo corpus."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    seed: int = Field(0, ge=0, description="Seed of the generator: same seed, same bytes.")
    people: int = Field(120, ge=4, le=600, description="People in the world.")
    documents: int = Field(3000, ge=1, description="Documents in the corpus.")
    parts: int = Field(4, ge=1, le=64, description="Corpus files (jsonl.gz) to spread them over.")
    task_examples: int = Field(2000, ge=10, description="Examples per downstream task.")


@dataclass(frozen=True)
class Person:
    """One person of the world and the facts about them."""

    name: str
    city: str
    job: str
    pet: str


def make_world(cfg: SyntheticConfig) -> list[Person]:
    """Create the people of the world (distinct names) from the seed."""
    rng = random.Random(cfg.seed)
    names = sorted({f"{f} {last}" for f in _FIRST for last in _LAST})
    return [
        Person(n, rng.choice(_CITIES), rng.choice(_JOBS), rng.choice(_PETS))
        for n in rng.sample(names, cfg.people)
    ]


def fact_sentence(person: Person, kind: str, value: str | None = None) -> str:
    """State one fact about `person` (optionally with a different, possibly false, value)."""
    if kind == "city":
        return f"{person.name} lives in {value or person.city}."
    if kind == "job":
        return f"{person.name} works as a {value or person.job}."
    return f"{person.name} has a {value or person.pet}."


def grammar_sentence(rng: random.Random, agree: bool = True) -> str:
    """Make a sentence with subject-verb agreement (or a deliberate violation)."""
    singular, plural = rng.choice(_NOUNS)
    verb_s, verb_p = rng.choice(_VERBS)
    plural_subject = rng.random() < 0.5
    verb = verb_p if plural_subject == agree else verb_s
    noun = plural if plural_subject else singular
    return f"The {rng.choice(_ADJS)} {noun} {verb} {rng.choice(_PLACES)}."


def make_document(rng: random.Random, world: list[Person]) -> str:
    """Make one document: a biography paragraph, or a story about a few people."""
    if rng.random() < 0.6:
        person = rng.choice(world)
        facts = [fact_sentence(person, kind) for kind in rng.sample(["city", "job", "pet"], 3)]
        filler = [grammar_sentence(rng) for _ in range(rng.randint(2, 5))]
        sentences = facts + filler
        rng.shuffle(sentences)
        return " ".join(sentences)
    cast = rng.sample(world, rng.randint(2, 3))
    sentences = []
    for person in cast:
        sentences.append(fact_sentence(person, rng.choice(["city", "job", "pet"])))
        sentences.append(grammar_sentence(rng))
    paragraphs = [
        " ".join(sentences[: len(sentences) // 2]),
        " ".join(sentences[len(sentences) // 2 :]),
    ]
    return "\n\n".join(paragraphs)


def write_corpus(out: Path, cfg: SyntheticConfig) -> list[Path]:
    """Write the corpus as `corpus/part-NNN.jsonl.gz` and the tasks as CSV; return the files.

    About 2% of documents are repeated verbatim, as in any scraped corpus, so dedup has work.
    """
    rng = random.Random(cfg.seed + 1)
    world = make_world(cfg)
    docs = [make_document(rng, world) for _ in range(cfg.documents)]
    docs += [docs[rng.randrange(len(docs))] for _ in range(cfg.documents // 50)]
    rng.shuffle(docs)
    files = []
    for part in range(cfg.parts):
        path = out / "corpus" / f"part-{part:03d}.jsonl.gz"
        with (
            atomic_writer(path) as raw,
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz,
        ):
            for i in range(part, len(docs), cfg.parts):
                gz.write((json.dumps({"id": i, "text": docs[i]}) + "\n").encode())
        files.append(path)
    files.append(_write_task(out / "tasks" / "facts.csv", _fact_rows(rng, world, cfg)))
    files.append(_write_task(out / "tasks" / "acceptability.csv", _acceptability_rows(rng, cfg)))
    return files


def _fact_rows(
    rng: random.Random, world: list[Person], cfg: SyntheticConfig
) -> list[tuple[str, int]]:
    rows = []
    pools = {"city": _CITIES, "job": _JOBS, "pet": _PETS}
    for _ in range(cfg.task_examples):
        person, kind = rng.choice(world), rng.choice(["city", "job", "pet"])
        truth = getattr(person, kind)
        label = int(rng.random() < 0.5)
        value = truth if label else rng.choice([v for v in pools[kind] if v != truth])
        rows.append((fact_sentence(person, kind, value), label))
    return rows


def _acceptability_rows(rng: random.Random, cfg: SyntheticConfig) -> list[tuple[str, int]]:
    rows = []
    for _ in range(cfg.task_examples):
        label = int(rng.random() < 0.5)
        rows.append((grammar_sentence(rng, agree=bool(label)), label))
    return rows


def _write_task(path: Path, rows: list[tuple[str, int]]) -> Path:
    """Write `sentence,label,split` CSV: 80% train, 10% validation, 10% test, in file order."""
    n = len(rows)
    with atomic_writer(path, "w") as handle:
        handle.write("sentence,label,split\n")
        for i, (sentence, label) in enumerate(rows):
            split = "train" if i < 0.8 * n else "validation" if i < 0.9 * n else "test"
            handle.write(f'"{sentence}",{label},{split}\n')
    return path
