"""Typing and checking of downstream records: source values in, canonical columns out.

`check_split` turns the raw values a reader found (`SourceRows`) into the typed values of the
canonical columns (`tasks/common/schema.py`) and collects one problem per bad record (a missing or
null value, text where a number belongs, tokens and tags of different lengths, an answer that is not
at its offset in the context). Label lookup is `index_labels` / `index_tags`, vectorised with
`pyarrow.compute`. Nothing here reads files or raises for a bad record: the loader
(`tasks/downstream/downstream.py`) decides, from `on_bad_row`, whether a problem refuses the whole
file.
"""

from __future__ import annotations

import math
import string
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.common import schema
from tasks.downstream.config import PromptTemplate
from tasks.downstream.readers import MISSING, SourceRows

#: Canonical keys of `DatasetConfig.columns` whose values are free text.
TEXT_KEYS = ("text", "text_pair", "question", "context", "target", "prompt", "response")
#: Where a rendered prompt comes from, in messages.
TEMPLATE = "prompt_template"
#: Prefix of the reader keys that hold a prompt template's fields.
TEMPLATE_FIELD = "@prompt."


@dataclass
class CheckedSplit:
    """One split's typed column values (a placeholder where a record is bad) and its problems."""

    rows: SourceRows
    values: dict[str, list[Any]] = field(default_factory=dict)
    problems: dict[int, str] = field(default_factory=dict)

    def flag(self, index: int, message: str) -> None:
        """Record the first problem of record `index` (later ones add nothing)."""
        self.problems.setdefault(index, message)


def describe(value: Any) -> str:
    """Name a bad value briefly for a message."""
    if value is MISSING:
        return "missing"
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def column_label(key: str, spec: Any) -> str:
    """Name a canonical column and the source field it is read from."""
    return f"column {key!r} (field {spec!r})"


def as_text(value: Any) -> str | None:
    """Return `value` if it is non-blank text, else None."""
    return value if isinstance(value, str) and value.strip() else None


def as_label(value: Any) -> str | None:
    """Return a class label's text (`1` and `"1"` alike), or None for no usable value."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return str(value)
    return None


def as_score(value: Any) -> float | None:
    """Return a finite float from a number or numeric text, else None."""
    if isinstance(value, bool):
        return None
    try:
        score = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        return None
    return score if math.isfinite(score) else None


def as_strings(value: Any) -> list[str] | None:
    """Return a non-empty list of text items (numbers become text), else None."""
    if not isinstance(value, list) or not value:
        return None
    items = [as_label(item) for item in value]
    return None if any(item is None for item in items) else [str(item) for item in items]


def as_answers(value: Any) -> tuple[list[str], list[int]] | None:
    """Return (texts, starts) from `{text: [...], answer_start: [...]}` or a list of answers.

    The first is the Hugging Face datasets layout, the second SQuAD's own; `[]` or empty lists
    mean an unanswerable question.
    """
    if isinstance(value, list):
        if not all(isinstance(a, dict) for a in value):
            return None
        value = {
            "text": [a.get("text") for a in value],
            "answer_start": [a.get("answer_start") for a in value],
        }
    if not isinstance(value, dict):
        return None
    texts, starts = value.get("text"), value.get("answer_start")
    if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
        return None
    if not all(isinstance(t, str) for t in texts):
        return None
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in starts):
        return None
    return texts, starts


_CONVERTERS: dict[str, tuple[Any, Any, str]] = {
    # key kind: (converter, placeholder for a bad record, what the value must be)
    "text": (as_text, "", "non-empty text"),
    "label": (as_label, "", "a label (text or number)"),
    "score": (as_score, 0.0, "a finite number"),
    "strings": (as_strings, [], "a non-empty list of text items"),
    "answers": (as_answers, ([], []), "answers: {text: [...], answer_start: [...]}"),
}


def convert(checked: CheckedSplit, key: str, spec: Any, kind: str) -> list[Any]:
    """Convert the values read for `key` with the converter of `kind`; flag the failures."""
    fn, placeholder, expected = _CONVERTERS[kind]
    out: list[Any] = []
    for index, value in enumerate(checked.rows.fields[key]):
        result = fn(value)
        if result is None:
            checked.flag(
                index, f"{column_label(key, spec)}: expected {expected}, found {describe(value)}"
            )
            result = placeholder
        out.append(result)
    return out


def render(template: str, values: dict[str, str]) -> str:
    """Fill a `{field}` template with `values`, literally (no attribute or index lookups)."""
    parts = []
    for literal, name, _, _ in string.Formatter().parse(template):
        parts.append(literal)
        if name is not None:
            parts.append(values[name])
    return "".join(parts)


def render_prompts(checked: CheckedSplit, template: PromptTemplate) -> list[str]:
    """Render each record's prompt; with the optional field empty, `text_if_empty` is used."""
    prompts = []
    for index in range(len(checked.rows)):
        values = {n: checked.rows.fields[TEMPLATE_FIELD + n][index] for n in template.fields()}
        bad = next((n for n, v in values.items() if not isinstance(v, str)), None)
        if bad is not None:
            where = column_label("prompt", f"{TEMPLATE}:{bad}")
            checked.flag(index, f"{where}: expected text, found {describe(values[bad])}")
            prompts.append("")
            continue
        optional = template.optional_field
        empty = optional is not None and not values[optional].strip()
        text = template.text_if_empty if empty and template.text_if_empty else template.text
        prompts.append(render(text, values))
    return prompts


def check_answer_offsets(checked: CheckedSplit) -> None:
    """Flag answers whose text is not found at their start offset in the context."""
    contexts = checked.values[schema.CONTEXT]
    for index, (texts, starts) in enumerate(checked.values["answers"]):
        for text, start in zip(texts, starts, strict=True):
            if contexts[index][start : start + len(text)] != text:
                excerpt = contexts[index][start : start + len(text) + 10]
                checked.flag(
                    index,
                    f"column 'answers': answer {text!r} is not at answer_start {start} of the "
                    f"context (found {excerpt!r})",
                )
                break


def check_tag_lengths(checked: CheckedSplit) -> None:
    """Flag records whose token and tag lists differ in length."""
    pairs = zip(checked.values[schema.TOKENS], checked.values[schema.TAGS], strict=True)
    for index, (tokens, tags) in enumerate(pairs):
        if len(tokens) != len(tags):
            checked.flag(index, f"{len(tokens)} tokens but {len(tags)} tags")


def check_unique_ids(checked: CheckedSplit, spec: Any) -> list[str]:
    """Return the example ids as text; flag nulls and every repeat of an id."""
    ids = convert(checked, schema.EXAMPLE_ID, spec, "label")
    seen: Counter[str] = Counter()
    for index, value in enumerate(ids):
        seen[value] += 1
        if seen[value] > 1 and index not in checked.problems:
            checked.flag(index, f"{column_label(schema.EXAMPLE_ID, spec)}: repeats {value!r}")
    return ids


def _unknown(values: list[str], labels: list[str]) -> np.ndarray:
    """Index of each value in `labels` (-1 where it is not a label), vectorised."""
    found = pc.index_in(pa.array(values, pa.string()), value_set=pa.array(labels, pa.string()))
    return np.asarray(pc.fill_null(found, -1).to_numpy(zero_copy_only=False), dtype=np.int32)


def _labels_text(labels: list[str]) -> str:
    shown = ", ".join(repr(label) for label in labels[:30])
    return f"[{shown}{', ...' if len(labels) > 30 else ''}]"


def index_labels(checked: CheckedSplit, raw: list[str], labels: list[str], spec: Any) -> pa.Array:
    """Return each record's label index (int32); flag a label that is not in `labels`."""
    found = _unknown(raw, labels)
    for index in np.flatnonzero(found < 0):
        checked.flag(
            int(index),
            f"{column_label(schema.LABEL, spec)}: unknown label {raw[index]!r}; "
            f"the labels are {_labels_text(labels)}",
        )
    return pa.array(np.maximum(found, 0), pa.int32())


def index_tags(
    checked: CheckedSplit, raw: list[list[str]], labels: list[str], spec: Any
) -> pa.Array:
    """Return each record's tag indexes (list<int32>); flag a tag that is not in `labels`."""
    offsets = np.zeros(len(raw) + 1, dtype=np.int32)
    np.cumsum([len(tags) for tags in raw], out=offsets[1:])
    flat = list(chain.from_iterable(raw))
    found = _unknown(flat, labels)
    for position in np.flatnonzero(found < 0):
        index = int(np.searchsorted(offsets, position, side="right")) - 1
        checked.flag(
            index,
            f"{column_label(schema.TAGS, spec)}: unknown tag {flat[position]!r} "
            f"(token {position - offsets[index] + 1}); the labels are {_labels_text(labels)}",
        )
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.maximum(found, 0), pa.int32()))
