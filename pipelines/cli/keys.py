"""What a recipe may say: the config sections each command reads, and every key of a section.

`lmpipe config --keys SECTION` prints each key under SECTION (e.g. `train.optim`) with its type,
its constraints, its default and its description, read from the pydantic models themselves
(`pipelines/config/` and the section models it composes), so the listing cannot drift from
what validation accepts. `COMMAND_SECTIONS` is what each command's `--help` lists. Nothing here
imports torch, Ray, Prefect, MLflow or transformers.
"""

from __future__ import annotations

import difflib
import functools
import json
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from pipelines.config import RunConfig

#: Sections every stage command reads besides its own: run identity, Ray, Prefect, MLflow.
RUN_SECTIONS = ("name", "workspace", "seed", "ray", "prefect", "tracking")
_DATA = ("ingest", "decontaminate", "tokenizer", "encode", "examples")
_UPSTREAM = "plus, without finetune.base, the pretrain command's sections"
#: The sections each command reads (besides `RUN_SECTIONS` for the stage commands), with a note.
COMMAND_SECTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "ingest": (("ingest",), ""),
    "tokenizer": (_DATA[:3], ""),
    "encode": (_DATA[:4], ""),
    "examples": (_DATA, ""),
    "examples inspect": (_DATA, ""),
    "pretrain": ((*_DATA, "train"), ""),
    "finetune": (("task", "finetune"), _UPSTREAM),
    "compare": (("task", "finetune", "compare"), _UPSTREAM),
    "evaluate": (("evaluate", "finetune.base", "task"), _UPSTREAM),
    "run": ((*_DATA, "train", "task", "finetune", "evaluate"), "every stage that has its section"),
    "config": ((), "the whole recipe"),
    "serve": (("deployments",), "and the sections of every flow it serves"),
    "submit": (("ray", "workspace"), "and the sections of the --stage it runs"),
    "gc": (("workspace", "tracking"), ""),
    "up": (("servers", "workspace"), ""),
    "down": (("servers", "workspace"), ""),
}


def sections_help(command: str) -> str:
    """The epilog of `lmpipe COMMAND --help`: the sections it reads and how to list their keys."""
    own, note = COMMAND_SECTIONS[command]
    stage = command not in ("config", "serve", "submit", "gc", "up", "down")
    names = [*own, *RUN_SECTIONS] if stage else list(own)
    listed = ", ".join(names) if names else "all sections"
    extra = f" ({note})" if note else ""
    example = own[-1] if own else "train.optim"
    return (
        f"config sections read: {listed}{extra}\n"
        f"every key of a section, with its type, default and meaning: lmpipe config --keys "
        f"SECTION (e.g. lmpipe config --keys {example}); the sections: lmpipe config --keys"
    )


@dataclass(frozen=True)
class Key:
    """One configurable key: its dotted path, type (with constraints), default, description."""

    path: str
    type: str
    default: str
    description: str


class UnknownSectionError(KeyError):
    """A `--keys` path that names no section or key; the message suggests close ones."""


def describe(section: str) -> list[Key]:
    """Every key under `section` (dotted, e.g. `train.optim`; "": the top-level keys only).

    A section's own row comes first, then its keys depth-first. List items appear as `<i>`,
    mapping values as `<name>`; the keys of each model a union allows are listed in turn.

    Raises:
        UnknownSectionError: `section` is no key of the recipe.
    """
    keys = _all_keys()
    if not section:
        return [k for k in keys if "." not in k.path]
    found = [k for k in keys if k.path == section or k.path.startswith(section + ".")]
    if not found:
        close = difflib.get_close_matches(section, [k.path for k in keys], n=3, cutoff=0.7)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise UnknownSectionError(
            f"{section!r} is no key of the recipe{hint} (`lmpipe config --keys` lists the sections)"
        )
    return found


@functools.cache
def _all_keys() -> list[Key]:
    return list(_keys(RunConfig, ""))


def format_keys(keys: list[Key], width: int = 100) -> str:
    """Render keys for a terminal: `path  type  = default`, then the description indented."""
    lines = []
    for key in keys:
        lines.append(f"{key.path}  {key.type}  = {key.default}")
        for line in textwrap.wrap(key.description, width - 4) or ["(no description)"]:
            lines.append(f"    {line}")
    return "\n".join(lines)


def _keys(model: type[BaseModel], prefix: str) -> Iterator[Key]:
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        yield _key(path, field)
        yield from _children(field.annotation, path)


def _children(annotation: Any, path: str) -> Iterator[Key]:
    """The keys of the models inside `annotation` (one model, a union of them, a list or dict)."""
    container = _container(annotation)
    models = _models_in(annotation)
    for model in models:
        inner = f"{path}.{container}" if container else path
        rows = _keys(model, inner)
        if len(models) > 1:  # a union: say which model each key belongs to
            rows = (
                Key(k.path, f"{k.type} [{model.__name__}]", k.default, k.description) for k in rows
            )
        yield from rows


def _key(path: str, field: FieldInfo) -> Key:
    models = _models_in(field.annotation)
    description = field.description or ""
    if not description and models:
        description = (models[0].__doc__ or "").strip().splitlines()[0]
    return Key(
        path, _type_name(field.annotation) + _constraints(field), _default(field), description
    )


def _container(annotation: Any) -> str | None:
    """`<i>` for a list of models, `<name>` for a mapping to models, None otherwise."""
    for arg in _flatten(annotation):
        origin = typing.get_origin(arg)
        if origin in (list, tuple, set) and any(_models_in(a) for a in typing.get_args(arg)):
            return "<i>"
        if origin is dict and _models_in(typing.get_args(arg)[-1]):
            return "<name>"
    return None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold, directly or as list/dict values."""
    found: list[type[BaseModel]] = []
    for arg in _flatten(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            found.append(arg)
        elif typing.get_origin(arg) in (list, tuple, set, dict):
            found += [m for a in typing.get_args(arg)[-1:] for m in _models_in(a)]
    return found


def _flatten(annotation: Any) -> list[Any]:
    """The members of a union (or `Annotated`), else the annotation itself."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _flatten(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in _flatten(arg)]
    return [annotation]


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(map(_type_name, args))}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(str(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _constraints(field: FieldInfo) -> str:
    """Bounds and length limits, e.g. ` (>= 1, <= 3)`, from the field's annotated metadata."""
    found = [
        f"{sign} {getattr(meta, attr)}"
        for meta in field.metadata
        for attr, sign in _BOUNDS
        if getattr(meta, attr, None) is not None
    ]
    for meta in field.metadata:
        if getattr(meta, "min_length", None) is not None:
            found.append(f"length >= {meta.min_length}")
        if getattr(meta, "max_length", None) is not None:
            found.append(f"length <= {meta.max_length}")
    return f" ({', '.join(found)})" if found else ""


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, SecretStr):
        return "(secret)"
    return _plain(value)


def _plain(value: Any) -> str:
    """A default as a recipe would write it (YAML-like JSON), shortened."""

    def encode(item: Any) -> Any:
        if isinstance(item, BaseModel):
            return item.model_dump(mode="json", exclude_defaults=True)
        if isinstance(item, Path | Enum):
            return str(getattr(item, "value", item))
        raise TypeError(type(item).__name__)

    try:
        text = json.dumps(value, default=encode)
    except TypeError:
        text = repr(value)
    text = "null" if value is None else text
    return text if len(text) <= 120 else text[:117] + "..."
