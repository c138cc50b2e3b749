"""`DatasetConfig`: one downstream dataset described by config alone, and its YAML loader.

A dataset is a task type, where its files are (one per split, one file cut into splits by a
column or by fractions, or a `datasets.save_to_disk` directory), how to parse them, which source
field feeds each canonical column (`tasks/common/schema.py`), and its label list. The values of the
real sets live in `configs/tasks/*.yaml`; reading and checking the files is
`tasks/downstream/downstream.py`.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.common import schema

TaskType = Literal[
    "classification",
    "regression",
    "token_classification",
    "question_answering",
    "seq2seq",
    "causal_lm",
]
Format = Literal["csv", "tsv", "json", "jsonl", "parquet", "hf_disk", "conll"]

#: Format by file suffix, where `format` is not set (a directory is `hf_disk`).
SUFFIX_FORMATS = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "jsonl"}
SUFFIX_FORMATS[".parquet"] = "parquet"

#: Canonical columns each task type needs from the source, and those it may take.
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "classification": ("text", "label"),
    "regression": ("text", "label"),
    "token_classification": ("tokens", "tags"),
    "question_answering": ("question", "context", "answers"),
    "seq2seq": ("text", "target"),
    "causal_lm": ("prompt", "response"),
}
OPTIONAL_COLUMNS: dict[str, tuple[str, ...]] = {
    "classification": ("text_pair", "example_id"),
    "regression": ("text_pair", "example_id"),
    "token_classification": ("example_id",),
    "question_answering": ("example_id",),
    "seq2seq": ("example_id",),
    "causal_lm": ("example_id",),
}
#: Token and tag positions on a CoNLL line unless `columns` says otherwise: first and last.
CONLL_DEFAULTS: dict[str, str | int] = {"tokens": 0, "tags": -1}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SPLIT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")

assert set(REQUIRED_COLUMNS) == set(schema.DOWNSTREAM_TASK_TYPES)  # the schema is the contract


def template_fields(template: str) -> list[str]:
    """Return the field names of a `{field}` template; format specs and conversions are refused.

    Raises:
        ValueError: a placeholder that is not a plain field name (`{0}`, `{a!r}`, `{a:>4}`).
    """
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name or spec or conversion or name.isdigit():
            raise ValueError(f"template placeholder {{{name}}} must be a plain field name")
        names.append(name)
    return names


class PromptTemplate(BaseModel):
    """How instruction records (Alpaca `instruction`/`input`/`output`) become a prompt.

    `{field}` placeholders name source fields (dotted paths allowed) and are filled literally.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    text: str = Field(description="The prompt, with `{field}` placeholders for source fields.")
    optional_field: str | None = Field(
        None, description="A field that may be empty; when it is, `text_if_empty` is used."
    )
    text_if_empty: str | None = Field(
        None, description="The prompt for records whose `optional_field` is empty."
    )

    @model_validator(mode="after")
    def _consistent(self) -> PromptTemplate:
        fields = template_fields(self.text)
        if (self.optional_field is None) != (self.text_if_empty is None):
            raise ValueError("set optional_field and text_if_empty together, or neither")
        if self.optional_field is not None and self.text_if_empty is not None:
            if self.optional_field not in fields:
                raise ValueError(f"optional_field {self.optional_field!r} is not in text")
            if self.optional_field in template_fields(self.text_if_empty):
                raise ValueError(f"text_if_empty must not use {{{self.optional_field}}}")
        return self

    def fields(self) -> list[str]:
        """Every source field either template reads, sorted."""
        return sorted(
            set(template_fields(self.text)) | set(template_fields(self.text_if_empty or ""))
        )


class DatasetConfig(BaseModel):
    """One downstream dataset: task type, files and splits, parsing, columns and labels."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(description="Task name: names outputs, reports and decontamination sets.")
    task_type: TaskType = Field(description="One of `tasks.common.schema.DOWNSTREAM_TASK_TYPES`.")
    format: Format | None = Field(
        None, description="Source format; default from the suffix (a directory: hf_disk)."
    )
    splits: dict[str, str] = Field(
        default_factory=dict,
        description="Split name -> file (or saved split directory), relative to base_dir.",
    )
    path: str | None = Field(
        None,
        description="One file cut into splits (by split_column or split_fractions), or a "
        "DatasetDict save_to_disk directory with its own splits; relative to base_dir.",
    )
    split_column: str | int | None = Field(
        None, description="Field of `path` whose value names each record's split."
    )
    split_values: dict[str, str] = Field(
        default_factory=dict,
        description="split_column value (as text) -> split name; other values are bad records.",
    )
    split_fractions: dict[str, float] = Field(
        default_factory=dict,
        description="Split -> fraction of `path`'s records, in file order (the last takes the "
        "rest); e.g. {train: 0.85, test: 0.1, validation: 0.05}.",
    )
    header: bool = Field(True, description="CSV/TSV: the first line names the columns.")
    delimiter: str | None = Field(
        None, description="Field separator; default ',' (csv), tab (tsv), whitespace (conll)."
    )
    quoting: bool | None = Field(
        None, description="CSV/TSV quote handling; default on for csv, off for tsv."
    )
    records_path: str | None = Field(
        None,
        description="JSON: dotted key path to the records (lists are walked, records inherit "
        "their parents' other fields), e.g. data.paragraphs.qas for SQuAD.",
    )
    columns: dict[str, str | int] = Field(
        default_factory=dict,
        description="Canonical column -> source field: a name, a dotted path into nested "
        "records (translation.en) or a 0-based position (csv/tsv/conll/parquet).",
    )
    labels: list[str] | None = Field(
        None,
        description="Ordered label (or tag) list; a label's index is its id. None: the sorted "
        "distinct values of the train split.",
    )
    prompt_template: PromptTemplate | None = Field(
        None, description="causal_lm: build `prompt` from source fields with this template."
    )
    max_examples: dict[str, int] = Field(
        default_factory=dict, description="Split -> at most this many examples (after checks)."
    )
    sample_seed: int | None = Field(
        None, description="None: max_examples keeps the first rows; a seed: a seeded sample."
    )
    on_bad_row: Literal["raise", "skip"] = Field(
        "raise", description="A bad record refuses the file (raise) or is dropped and counted."
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError(f"{value!r} must be 1-64 letters, digits, '_', '.' or '-'")
        return value

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_as_text(cls, value: Any) -> Any:
        # YAML reads `[0, 1]` as numbers; source values are compared as text.
        if isinstance(value, list):
            return [str(v) if isinstance(v, int | float | bool) else v for v in value]
        return value

    @field_validator("split_values", mode="before")
    @classmethod
    def _values_as_text(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k) if isinstance(k, int | float | bool) else k: v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _consistent(self) -> DatasetConfig:
        _check_sources(self)
        _check_columns(self)
        _check_labels(self)
        _check_delimiter(self)
        return self

    def split_names(self) -> list[str]:
        """The split names the config declares (empty for a saved DatasetDict's own splits)."""
        if self.splits:
            return list(self.splits)
        if self.split_fractions:
            return list(self.split_fractions)
        return list(dict.fromkeys(self.split_values.values()))

    def source_columns(self) -> dict[str, str | int]:
        """Canonical column -> source field, CoNLL defaults included."""
        if self.format == "conll":
            return {**CONLL_DEFAULTS, **self.columns}
        return dict(self.columns)

    def pair(self) -> bool:
        """Whether examples are sentence pairs (`text_pair` is mapped)."""
        return schema.TEXT_PAIR in self.columns


def _check_sources(cfg: DatasetConfig) -> None:
    if bool(cfg.splits) == (cfg.path is not None):
        raise ValueError("give either `splits` (a file per split) or `path` (one source)")
    by_column = cfg.split_column is not None or bool(cfg.split_values)
    if cfg.splits and (by_column or cfg.split_fractions):
        raise ValueError("split_column/split_values/split_fractions need `path`, not `splits`")
    if cfg.path is not None and cfg.format != "hf_disk" and by_column == bool(cfg.split_fractions):
        raise ValueError(
            "`path` needs exactly one way to split it: split_column + split_values, or "
            "split_fractions (or format: hf_disk for a saved DatasetDict)"
        )
    if cfg.format == "hf_disk" and cfg.path is not None and (by_column or cfg.split_fractions):
        raise ValueError("a saved DatasetDict brings its own splits; drop split_* options")
    if by_column and (cfg.split_column is None or not cfg.split_values):
        raise ValueError("split_column and split_values go together")
    fractions = list(cfg.split_fractions.values())
    if fractions and (min(fractions) <= 0 or abs(sum(fractions) - 1) > 1e-6):
        raise ValueError(f"split_fractions must be positive and sum to 1, not {sum(fractions)}")
    for split in [*cfg.split_names(), *cfg.max_examples]:
        if not _SPLIT.fullmatch(split):
            raise ValueError(f"split name {split!r} must be 1-64 letters, digits, '_' or '-'")
    for split, count in cfg.max_examples.items():
        if count < 1:
            raise ValueError(f"max_examples.{split} must be at least 1, not {count}")


def _check_columns(cfg: DatasetConfig) -> None:
    required = REQUIRED_COLUMNS[cfg.task_type]
    allowed = {*required, *OPTIONAL_COLUMNS[cfg.task_type]}
    columns = cfg.source_columns()
    unknown = sorted(set(columns) - allowed)
    if unknown:
        raise ValueError(
            f"columns {unknown} do not belong to {cfg.task_type}; use {sorted(allowed)}"
        )
    if cfg.prompt_template is not None:
        if cfg.task_type != "causal_lm" or "prompt" in columns:
            raise ValueError("prompt_template builds `prompt` for causal_lm; do not map prompt too")
        columns["prompt"] = "template"
    missing = [key for key in required if key not in columns]
    if missing:
        raise ValueError(
            f"{cfg.task_type} needs columns {missing} (canonical name -> source field)"
        )
    if cfg.format == "conll" and (
        cfg.task_type != "token_classification" or set(columns) != {"tokens", "tags"}
    ):
        raise ValueError("format conll reads tokens and tags only (token_classification)")
    if cfg.format == "conll" and not all(isinstance(v, int) for v in columns.values()):
        raise ValueError(f"format conll fields are 0-based positions, not names: {columns}")
    positional = [k for k, v in columns.items() if isinstance(v, int) and k != "prompt"]
    if isinstance(cfg.split_column, int):
        positional.append("split_column")
    if positional and cfg.format in ("json", "jsonl", "hf_disk"):
        raise ValueError(f"{positional}: {cfg.format} fields are named, not numbered")
    named = [k for k, v in cfg.columns.items() if isinstance(v, str)]
    if not cfg.header and cfg.format in (None, "csv", "tsv") and named:
        raise ValueError(f"header: false needs column positions, not names, for {named}")


def _check_delimiter(cfg: DatasetConfig) -> None:
    if cfg.delimiter is None:
        return
    if cfg.format == "conll":
        if not cfg.delimiter:
            raise ValueError("delimiter must not be empty")
    elif len(cfg.delimiter) != 1 or cfg.delimiter in '"\r\n':
        # Python's csv module takes one character, and a quote or line break cannot separate.
        raise ValueError(
            f"delimiter {cfg.delimiter!r} must be one character, not a quote or newline"
        )


def _check_labels(cfg: DatasetConfig) -> None:
    if cfg.labels is None:
        return
    if cfg.task_type not in ("classification", "token_classification"):
        raise ValueError(f"labels belong to classification tasks, not {cfg.task_type}")
    if not cfg.labels or len(set(cfg.labels)) != len(cfg.labels):
        raise ValueError(f"labels must be a non-empty list without repeats: {cfg.labels}")


class DatasetConfigError(ValueError):
    """A task YAML file is unreadable or invalid; the message names the file and the key."""


class _SafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` whose failures to build a scalar are YAML errors with their line.

    PyYAML's own constructors raise ValueError (`2001-13-01`, `!!int abc`), AttributeError
    (`!!timestamp foo`) and the like, which name neither the line nor the value.
    """

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            problem = f"cannot read {node.tag} {str(node.value)[:80]!r}: {exc}"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


def parse_yaml(text: str) -> Any:
    """Parse YAML like `yaml.safe_load`, but fail only with `yaml.YAMLError`.

    Raises:
        yaml.YAMLError: invalid YAML, a value that cannot be built (with its line), or nesting
            too deep to parse.
    """
    try:
        return yaml.load(text, Loader=_SafeLoader)  # safe: a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("the document is nested too deeply") from None


def load_dataset_config(path: Path | str) -> DatasetConfig:
    """Read one task YAML file (`configs/tasks/*.yaml`) into a `DatasetConfig`.

    Raises:
        DatasetConfigError: a missing file, invalid YAML, or an invalid key or value.
    """
    path = Path(path)
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetConfigError(f"{path}: no such task config") from None
    except OSError as exc:  # a directory, no permission
        raise DatasetConfigError(f"{path}: cannot read the task config: {exc}") from None
    except UnicodeDecodeError as exc:
        raise DatasetConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise DatasetConfigError(f"{path}: invalid YAML: {exc}") from None
    try:
        return DatasetConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors()
        )
        raise DatasetConfigError(f"{path}: {problems}") from None
