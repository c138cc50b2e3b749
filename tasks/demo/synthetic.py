"""A deterministic synthetic corpus with learnable structure, and labelled tasks drawn from it.

The world: people with one-word names, each with a home city, a profession and a pet (facts that
recur across many documents), and a grammar of sentences with subject-verb agreement. Documents
are biographies, short stories and town registers. Same seed, same bytes.

The downstream tasks (`sentence,label,split` CSV files):

- `residence.csv`: "Where does Tavor live?" -> one of 12 cities. The people of the test and
  validation splits never occur in the train split, so only what a model learnt from the corpus
  can answer for them: from random initialisation the test accuracy is chance (1/12; every city
  has the same number of people in every split). This is the task that shows pretraining helps.
- `facts.csv`: fact verification ("Is it true that Tavor lives in Oslo?" -> 1 or 0), with the
  same person-disjoint splits.
- `acceptability.csv`: is the subject-verb agreement right?
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.common.io import atomic_writer

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
# Names are consonant-vowel-consonant-vowel-consonant words ("Tavor"): 15*5*15*5*4 = 22,500 of
# them, one word each, so a WordPiece vocabulary of a few thousand keeps them whole.
_ONSETS = "bdfghklmnprstvz"
_VOWELS = "aeiou"
_CODAS = "lnrs"

#: How the corpus states each kind of fact; the tasks ask in other words ("Where does X live?").
CORPUS_FORMS: dict[str, tuple[str, ...]] = {
    "city": ("{name} lives in {value}.", "{name} has a home in {value}."),
    "job": ("{name} works as a {value}.",),
    "pet": ("{name} has a {value}.",),
}
KINDS = ("city", "job", "pet")
#: Train questions of the residence task; validation and test ask with the first one only.
RESIDENCE_QUESTIONS = (
    "Where does {name} live?",
    "In which city does {name} live?",
    "Which city is home to {name}?",
)
Row = tuple[str, str, str]  # a task row: sentence, label, split
_SPLITS = ("train", "validation", "test")
_CLAIMS = {
    "city": "Is it true that {name} lives in {value}?",
    "job": "Is it true that {name} is a {value}?",
    "pet": "Is it true that {name} keeps a {value}?",
}


class SyntheticConfig(BaseModel):
    """Size, seed and mix of the synthetic demo corpus and its tasks."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    seed: int = Field(0, ge=0, description="Seed of the generator: same seed, same bytes.")
    people: int = Field(
        120, ge=36, le=600, description="People in the world (a multiple of 12 keeps cities even)."
    )
    documents: int = Field(3000, ge=1, description="Documents in the corpus.")
    parts: int = Field(4, ge=1, le=64, description="Corpus files (jsonl.gz) to spread them over.")
    task_examples: int = Field(
        2000,
        ge=10,
        description="Examples of the acceptability task (the fact tasks have a fixed number "
        "per person).",
    )
    register_share: float = Field(
        0.6, ge=0, le=1, description="Share of documents that are town registers (city facts)."
    )
    test_share: float = Field(
        0.4, gt=0, lt=1, description="Share of each city's people in the fact tasks' test split."
    )
    validation_share: float = Field(
        0.1, gt=0, lt=1, description="Share of each city's people in the validation split."
    )

    @model_validator(mode="after")
    def _every_split_has_people(self) -> SyntheticConfig:
        smallest = self.people // len(_CITIES)
        n_test, n_val = split_sizes(smallest, self.test_share, self.validation_share)
        if smallest - n_test - n_val < 1:
            raise ValueError(
                f"people={self.people} leaves no train person per city after test_share="
                f"{self.test_share} and validation_share={self.validation_share}"
            )
        return self


def split_sizes(city_people: int, test_share: float, validation_share: float) -> tuple[int, int]:
    """How many of a city's people go to the test and the validation split (at least one each)."""
    n_test = max(1, round(test_share * city_people))
    return n_test, max(1, round(validation_share * city_people))


@dataclass(frozen=True)
class Person:
    """One person of the world and the facts about them."""

    name: str
    city: str
    job: str
    pet: str


def _names(rng: random.Random, count: int) -> list[str]:
    """Draw `count` distinct one-word names that are not words of the corpus."""
    taken = {w.lower() for w in _CITIES + _JOBS + _PETS + _ADJS}
    taken |= {w for pair in _NOUNS + _VERBS for w in pair}
    names: set[str] = set()
    while len(names) < count:
        o1, o2 = rng.choice(_ONSETS), rng.choice(_ONSETS)
        v1, v2 = rng.choice(_VOWELS), rng.choice(_VOWELS)
        name = f"{o1}{v1}{o2}{v2}{rng.choice(_CODAS)}"
        if name not in taken:
            names.add(name)
    return [n.capitalize() for n in sorted(names)]


def _balanced(rng: random.Random, values: list[str], count: int) -> list[str]:
    """`count` values, each of `values` as often as possible, in a seeded order."""
    out = [values[i % len(values)] for i in range(count)]
    rng.shuffle(out)
    return out


def make_world(cfg: SyntheticConfig) -> list[Person]:
    """Create the people of the world (distinct one-word names, cities evenly spread)."""
    rng = random.Random(cfg.seed)
    names = _names(rng, cfg.people)
    rng.shuffle(names)
    cities = _balanced(rng, _CITIES, cfg.people)
    jobs = _balanced(rng, _JOBS, cfg.people)
    pets = _balanced(rng, _PETS, cfg.people)
    return [Person(*fields) for fields in zip(names, cities, jobs, pets, strict=True)]


def fact_sentence(person: Person, kind: str, value: str | None = None, form: int = 0) -> str:
    """State one fact about `person` in the corpus's words (optionally with another value)."""
    forms = CORPUS_FORMS[kind]
    true_value = getattr(person, kind)
    return forms[form % len(forms)].format(name=person.name, value=value or true_value)


def grammar_sentence(rng: random.Random, agree: bool = True) -> str:
    """Make a sentence with subject-verb agreement (or a deliberate violation)."""
    singular, plural = rng.choice(_NOUNS)
    verb_s, verb_p = rng.choice(_VERBS)
    plural_subject = rng.random() < 0.5
    verb = verb_p if plural_subject == agree else verb_s
    noun = plural if plural_subject else singular
    return f"The {rng.choice(_ADJS)} {noun} {verb} {rng.choice(_PLACES)}."


def _random_fact(rng: random.Random, person: Person, kind: str) -> str:
    return fact_sentence(person, kind, form=rng.randrange(len(CORPUS_FORMS[kind])))


def _biography(rng: random.Random, world: list[Person]) -> str:
    """One person's three facts among a few grammar sentences."""
    person = rng.choice(world)
    sentences = [_random_fact(rng, person, kind) for kind in KINDS]
    sentences += [grammar_sentence(rng) for _ in range(rng.randint(1, 3))]
    rng.shuffle(sentences)
    return " ".join(sentences)


def _story(rng: random.Random, world: list[Person]) -> str:
    """Two paragraphs about a few people, one fact and one grammar sentence each."""
    sentences = []
    for person in rng.sample(world, rng.randint(2, 3)):
        sentences.append(_random_fact(rng, person, rng.choice(KINDS)))
        sentences.append(grammar_sentence(rng))
    half = len(sentences) // 2
    return " ".join(sentences[:half]) + "\n\n" + " ".join(sentences[half:])


def _register(rng: random.Random, world: list[Person]) -> str:
    """A town register: where each of several people lives, one short sentence each."""
    return " ".join(fact_sentence(p, "city") for p in rng.sample(world, rng.randint(8, 14)))


def make_document(rng: random.Random, world: list[Person], register_share: float = 0.6) -> str:
    """Make one document: a town register, a biography or a story about a few people."""
    draw = rng.random()
    if draw < register_share:
        return _register(rng, world)
    if draw < register_share + (1 - register_share) * 0.6:
        return _biography(rng, world)
    return _story(rng, world)


def write_corpus(out: Path, cfg: SyntheticConfig) -> list[Path]:
    """Write the corpus as `corpus/part-NNN.jsonl.gz` and the tasks as CSV; return the files.

    About 2% of documents are repeated verbatim, as in any scraped corpus, so dedup has work.
    """
    rng = random.Random(cfg.seed + 1)
    world = make_world(cfg)
    docs = [make_document(rng, world, cfg.register_share) for _ in range(cfg.documents)]
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
    splits = person_splits(world, cfg)
    tasks = out / "tasks"
    files.append(_write_task(tasks / "residence.csv", residence_rows(world, splits)))
    files.append(_write_task(tasks / "facts.csv", fact_rows(rng, world, splits)))
    files.append(_write_task(tasks / "acceptability.csv", _acceptability_rows(rng, cfg)))
    return files


def person_splits(world: list[Person], cfg: SyntheticConfig) -> dict[str, str]:
    """Assign each person to the train, validation or test split, evenly within each city.

    Within each city (in world order) the first `test_share` of its people go to test, the next
    `validation_share` to validation (at least one each), the rest to train; so no split shares a
    person with another, and every city is as frequent in a split as any other.
    """
    by_city: dict[str, list[Person]] = {}
    for person in world:
        by_city.setdefault(person.city, []).append(person)
    splits = {}
    for people in by_city.values():
        n_test, n_val = split_sizes(len(people), cfg.test_share, cfg.validation_share)
        for i, person in enumerate(people):
            splits[person.name] = (
                "test" if i < n_test else "validation" if i < n_test + n_val else "train"
            )
    return splits


def residence_rows(world: list[Person], splits: dict[str, str]) -> list[Row]:
    """One question per person (every train question form for train people): the city."""
    rows = []
    for person in world:
        split = splits[person.name]
        forms = RESIDENCE_QUESTIONS if split == "train" else RESIDENCE_QUESTIONS[:1]
        rows += [(form.format(name=person.name), person.city, split) for form in forms]
    return _split_order(rows)


def fact_rows(rng: random.Random, world: list[Person], splits: dict[str, str]) -> list[Row]:
    """Per person and kind of fact, one true and one false claim (label 1 / 0)."""
    pools = {"city": _CITIES, "job": _JOBS, "pet": _PETS}
    rows = []
    for person in world:
        for kind in KINDS:
            truth = getattr(person, kind)
            wrong = rng.choice([v for v in pools[kind] if v != truth])
            for value, label in ((truth, "1"), (wrong, "0")):
                claim = _CLAIMS[kind].format(name=person.name, value=value)
                rows.append((claim, label, splits[person.name]))
    return _split_order(rows)


def _split_order(rows: list[Row]) -> list[Row]:
    """The rows grouped by split (train, validation, test), in their order within each."""
    return sorted(rows, key=lambda row: _SPLITS.index(row[2]))


def _acceptability_rows(rng: random.Random, cfg: SyntheticConfig) -> list[Row]:
    """Grammatical (1) and agreement-violating (0) sentences: 80/10/10 train/validation/test."""
    rows = []
    n = cfg.task_examples
    for i in range(n):
        label = int(rng.random() < 0.5)
        split = "train" if i < 0.8 * n else "validation" if i < 0.9 * n else "test"
        rows.append((grammar_sentence(rng, agree=bool(label)), str(label), split))
    return rows


def _write_task(path: Path, rows: list[Row]) -> Path:
    """Write a `sentence,label,split` CSV (sentences quoted)."""
    with atomic_writer(path, "w") as handle:
        handle.write("sentence,label,split\n")
        for sentence, label, split in rows:
            handle.write(f'"{sentence}",{label},{split}\n')
    return path
