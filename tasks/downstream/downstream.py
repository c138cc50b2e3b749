"""Downstream data: read a dataset described by a `DatasetConfig` into canonical Arrow tables.

`load_downstream(cfg, base_dir)` reads the configured files, cuts them into splits, types and
checks every record, resolves the label list and returns one table per split in exactly
`schema.downstream_schema(task_type, pair)`, with per-split counts (read = refused + dropped +
kept). A missing column, an unknown label, a malformed line or an empty split is refused with a
message naming the file, the column and the line (or row, or record). The config model lives in
`tasks/downstream/config.py`, file parsing in `tasks/downstream/readers.py`, value checks in
`tasks/downstream/checks.py`, and the stage that writes prepared splits in
`tasks/downstream/stage.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tasks.common import schema
from tasks.downstream.checks import (
    TEMPLATE_FIELD,
    CheckedSplit,
    check_answer_offsets,
    check_tag_lengths,
    check_unique_ids,
    convert,
    index_labels,
    index_tags,
    render_prompts,
)
from tasks.downstream.config import SUFFIX_FORMATS, DatasetConfig, load_dataset_config
from tasks.downstream.readers import (
    MISSING,
    DownstreamDataError,
    ReadOptions,
    SourceRows,
    hf_splits,
    read_source,
)

__all__ = [
    "DatasetConfig",
    "DownstreamData",
    "DownstreamDataError",
    "SplitCounts",
    "load_dataset_config",
    "load_downstream",
    "source_paths",
]

_SPLIT_KEY = "@split"
#: The converter kind of each canonical column with a single source field.
_KINDS = {
    "text": "text",
    "text_pair": "text",
    "question": "text",
    "context": "text",
    "target": "text",
    "prompt": "text",
    "response": "text",
    "tokens": "strings",
    "tags": "strings",
    "answers": "answers",
}


@dataclass(frozen=True)
class SplitCounts:
    """Records of one split: read = refused (bad) + dropped (over max_examples) + kept."""

    read: int
    refused: int
    dropped: int
    kept: int


@dataclass(frozen=True)
class DownstreamData:
    """A loaded downstream dataset: one canonical table per split, its labels and counts.

    `unassigned` counts records of a single-file source that no split could take (a malformed
    record, or a split value not in `split_values`) and that `on_bad_row: skip` dropped.
    """

    name: str
    task_type: str
    pair: bool
    labels: tuple[str, ...]
    splits: dict[str, pa.Table]
    counts: dict[str, SplitCounts]
    unassigned: int = 0


def resolve_format(cfg: DatasetConfig, path: Path) -> str:
    """The configured format, else the one the suffix names (a directory is `hf_disk`)."""
    if cfg.format is not None:
        return cfg.format
    if path.is_dir():
        return "hf_disk"
    if path.suffix.lower() not in SUFFIX_FORMATS:
        raise DownstreamDataError(
            f"{path}: cannot tell the format from the suffix; set format to one of "
            f"{sorted({*SUFFIX_FORMATS.values(), 'conll', 'hf_disk'})}"
        )
    return SUFFIX_FORMATS[path.suffix.lower()]


def source_paths(cfg: DatasetConfig, base_dir: Path) -> list[tuple[str | None, Path]]:
    """List (split, file) to read; split is None for one file that is cut into splits.

    Relative paths resolve against `base_dir`.
    """
    if cfg.splits:
        return [(split, base_dir / file) for split, file in cfg.splits.items()]
    assert cfg.path is not None  # the config guarantees splits or path
    root = base_dir / cfg.path
    if resolve_format(cfg, root) == "hf_disk" and not (root / "state.json").is_file():
        return [(split, root / split) for split in hf_splits(root)]
    return [(None, root)]


def _wanted(cfg: DatasetConfig) -> dict[str, str | int]:
    """Reader key -> source field: canonical columns, template fields and the split column."""
    wanted = {k: v for k, v in cfg.source_columns().items()}
    if cfg.prompt_template is not None:
        wanted |= {TEMPLATE_FIELD + name: name for name in cfg.prompt_template.fields()}
    if cfg.split_column is not None:
        wanted[_SPLIT_KEY] = cfg.split_column
    return wanted


def _read(cfg: DatasetConfig, path: Path) -> SourceRows:
    fmt = resolve_format(cfg, path)
    wanted = _wanted(cfg)
    numbered = [key for key, spec in wanted.items() if isinstance(spec, int)]
    if numbered and fmt in ("json", "jsonl", "hf_disk"):
        raise DownstreamDataError(f"{path}: {fmt} fields are named, not numbered ({numbered})")
    opts = ReadOptions(cfg.header, cfg.delimiter, cfg.quoting, cfg.records_path)
    return read_source(path, fmt, wanted, opts)


def _refuse(rows: SourceRows, problems: dict[int, str], what: str) -> DownstreamDataError:
    first = min(problems)
    more = len(problems) - 1
    tail = f" ({more} more bad {what}; on_bad_row: skip drops them)" if more else ""
    return DownstreamDataError(f"{rows.where(first)}: {problems[first]}{tail}")


def _empty(cfg: DatasetConfig, split: str, rows: SourceRows, refused: int = 0) -> Exception:
    return DownstreamDataError(
        f"{rows.file}: split {split!r} of {cfg.name} is empty "
        f"({len(rows)} records read, {refused} refused)"
    )


def cut_splits(cfg: DatasetConfig, rows: SourceRows) -> tuple[dict[str, SourceRows], int]:
    """Cut one file's records into splits, by split column or fractions in file order.

    Returns the splits and the number of records no split could take (`on_bad_row: skip`).
    """
    if cfg.split_fractions:
        splits, start = {}, 0
        names = list(cfg.split_fractions)
        for i, (split, fraction) in enumerate(cfg.split_fractions.items()):
            stop = len(rows) if i == len(names) - 1 else start + int(len(rows) * fraction)
            splits[split] = rows.take(list(range(start, stop)))
            start = stop
        return splits, 0
    members: dict[str, list[int]] = {split: [] for split in cfg.split_names()}
    lost: dict[int, str] = {}
    for index, value in enumerate(rows.fields[_SPLIT_KEY]):
        key = None if value is MISSING or value is None else str(value)
        if index in rows.problems:
            lost[index] = rows.problems[index]
        elif key not in cfg.split_values:
            known = sorted(cfg.split_values)
            lost[index] = f"split_column {cfg.split_column!r} is {key!r}, not one of {known}"
        else:
            members[cfg.split_values[key]].append(index)
    if lost and cfg.on_bad_row == "raise":
        raise _refuse(rows, lost, "records")
    return {split: rows.take(indexes) for split, indexes in members.items()}, len(lost)


def check_split(cfg: DatasetConfig, rows: SourceRows) -> CheckedSplit:
    """Type every canonical column of one split's records and flag the bad ones.

    Class labels and tags stay text here; `index_labels` / `index_tags` map them to ids once
    the label list is known.
    """
    checked = CheckedSplit(rows, problems=dict(rows.problems))
    columns = cfg.source_columns()
    for key, spec in columns.items():
        if key == "label":
            kind = "score" if cfg.task_type == "regression" else "label"
            checked.values[key] = convert(checked, key, spec, kind)
        elif key == schema.EXAMPLE_ID:
            checked.values[key] = check_unique_ids(checked, spec)
        else:
            checked.values[key] = convert(checked, key, spec, _KINDS[key])
    if cfg.prompt_template is not None:
        checked.values["prompt"] = render_prompts(checked, cfg.prompt_template)
    if cfg.task_type == "token_classification":
        check_tag_lengths(checked)
    if cfg.task_type == "question_answering":
        check_answer_offsets(checked)
    return checked


def resolve_labels(cfg: DatasetConfig, checked: dict[str, CheckedSplit]) -> tuple[str, ...]:
    """The configured labels, else the sorted distinct labels (or tags) of the train split.

    Sorting is by code point (`"0" < "1"`, `"B-LOC" < "I-LOC" < "O"`), so the same train data
    always gives the same ids. Regression and the generative tasks have no labels.
    """
    if cfg.task_type not in ("classification", "token_classification"):
        return ()
    if cfg.labels is not None:
        return tuple(cfg.labels)
    if "train" not in checked:
        raise DownstreamDataError(
            f"{cfg.name}: no labels configured and no train split to derive them from"
        )
    train = checked["train"]
    key = "label" if cfg.task_type == "classification" else "tags"
    good = [v for i, v in enumerate(train.values[key]) if i not in train.problems]
    values = good if key == "label" else [tag for tags in good for tag in tags]
    if not values:
        raise DownstreamDataError(f"{cfg.name}: the train split has no labels to derive from")
    return tuple(sorted(set(values)))


def _columns(cfg: DatasetConfig, checked: CheckedSplit, labels: list[str]) -> dict[str, Any]:
    """The typed columns of one split, labels and tags as ids (this may flag more records)."""
    columns = cfg.source_columns()
    values = dict(checked.values)
    if cfg.task_type == "classification":
        values["label"] = index_labels(checked, values["label"], labels, columns["label"])
    elif cfg.task_type == "token_classification":
        values["tags"] = index_tags(checked, values["tags"], labels, columns["tags"])
    if cfg.task_type == "question_answering":
        answers = values.pop("answers")
        values[schema.ANSWER_TEXTS] = [texts for texts, _ in answers]
        values[schema.ANSWER_STARTS] = [starts for _, starts in answers]
    return values


def sample_rows(count: int, limit: int | None, seed: int | None) -> np.ndarray | None:
    """Row numbers to keep under `limit`: the first ones, or a seeded sample in file order."""
    if limit is None or limit >= count:
        return None
    if seed is None:
        return np.arange(limit)
    return np.sort(np.random.default_rng(seed).choice(count, size=limit, replace=False))


def _table(cfg: DatasetConfig, values: dict[str, Any], ids: list[str]) -> pa.Table:
    target = schema.downstream_schema(cfg.task_type, cfg.pair())
    data = {schema.EXAMPLE_ID: ids} | {name: values[name] for name in target.names[1:]}
    return pa.table({f.name: pa.array(data[f.name], f.type) for f in target}, schema=target)


def finish_split(
    cfg: DatasetConfig, split: str, checked: CheckedSplit, labels: list[str]
) -> tuple[pa.Table, SplitCounts]:
    """Build one split's table: ids, label lookup, bad-record policy, then max_examples."""
    values = _columns(cfg, checked, labels)
    rows = checked.rows
    if checked.problems and cfg.on_bad_row == "raise":
        raise _refuse(rows, checked.problems, "records in this split")
    ids = values.pop(schema.EXAMPLE_ID, None) or [f"{split}-{i}" for i in range(len(rows))]
    table = _table(cfg, values, ids)
    keep = np.ones(len(rows), dtype=bool)
    keep[list(checked.problems)] = False
    table = table.filter(pa.array(keep))
    if table.num_rows == 0:
        raise _empty(cfg, split, rows, len(checked.problems))
    picks = sample_rows(table.num_rows, cfg.max_examples.get(split), cfg.sample_seed)
    kept = table if picks is None else table.take(pa.array(picks))
    counts = SplitCounts(
        read=len(rows),
        refused=len(checked.problems),
        dropped=table.num_rows - kept.num_rows,
        kept=kept.num_rows,
    )
    return kept, counts


def read_splits(cfg: DatasetConfig, base_dir: Path) -> tuple[dict[str, SourceRows], int]:
    """Read every source and return each split's records, plus the records no split took."""
    splits: dict[str, SourceRows] = {}
    unassigned = 0
    for split, path in source_paths(cfg, base_dir):
        rows = _read(cfg, path)
        if split is not None:
            splits[split] = rows
            continue
        cut, lost = cut_splits(cfg, rows)
        splits |= cut
        unassigned += lost
    unknown = sorted(set(cfg.max_examples) - set(splits))
    if unknown:
        raise DownstreamDataError(f"{cfg.name}: max_examples names unknown splits {unknown}")
    return splits, unassigned


def load_downstream(cfg: DatasetConfig, base_dir: Path | str) -> DownstreamData:
    """Read, check and type a downstream dataset; one `downstream_schema` table per split.

    Raises:
        DownstreamDataError: a missing file or column, an unknown label, a malformed or
            otherwise bad record (unless `on_bad_row: skip`), or an empty split.
    """
    raw, unassigned = read_splits(cfg, Path(base_dir))
    for split, rows in raw.items():
        if not rows.locations:
            raise _empty(cfg, split, rows)
    checked = {split: check_split(cfg, rows) for split, rows in raw.items()}
    labels = resolve_labels(cfg, checked)
    tables: dict[str, pa.Table] = {}
    counts: dict[str, SplitCounts] = {}
    for split, part in checked.items():
        tables[split], counts[split] = finish_split(cfg, split, part, list(labels))
    return DownstreamData(
        name=cfg.name,
        task_type=cfg.task_type,
        pair=cfg.pair(),
        labels=labels,
        splits=tables,
        counts=counts,
        unassigned=unassigned,
    )
