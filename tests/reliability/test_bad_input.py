"""Bad input: property-based tests over every reader of user-supplied input.

The config loader (`pipelines.config`, `tasks.downstream.config`), the ingestion readers (txt,
jsonl, json, csv, tsv, parquet, compressed) and the downstream readers (csv, tsv, jsonl, json,
conll, parquet) get generated input: random bytes, broken encodings, truncated gzip, wrong JSON
types, missing fields, huge and empty lines, BOMs and NULs. For every input a reader either
succeeds or refuses with the module's declared error naming the file (and line, field or key),
or quarantines the record naming its file and line; and nothing is lost: counts reconcile
exactly, and equal what the generator wrote where that is knowable.

Quick mode (`make test`) runs about 30 derandomized examples per property; `LMPIPE_RELIABILITY=full`
runs 500. Each property records examples, refusals and uncaught exceptions under
`test-artifacts/reliability/<quick|full>/bad_input.json`.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from figures import FULL, REPO, record
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pipelines.config import ConfigError, RunConfig, load_config, read_recipe
from tasks.common.io import read_ipc_stream
from tasks.downstream.config import DatasetConfig, DatasetConfigError, load_dataset_config
from tasks.downstream.downstream import load_downstream
from tasks.downstream.readers import DownstreamDataError
from tasks.ingest.ingest import IngestConfig, UnitJob, process_unit
from tasks.ingest.output import dedup_documents, load_keys, reconcile_counts, write_quarantine
from tasks.ingest.readers import plan_units
from tasks.ingest.sources import InputError, SourceConfig, expand_source

pytestmark = [pytest.mark.reliability]

settings.register_profile(
    "bad_input_quick",
    max_examples=30,
    deadline=None,
    derandomize=True,  # CI is reproducible: the same 30 examples every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "bad_input_full",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile("bad_input_full" if FULL else "bad_input_quick")

#: Per property: examples run and refusals (declared errors and quarantined records).
TALLY: dict[str, Counter[str]] = {}


def tally(name: str, **counts: int) -> None:
    TALLY.setdefault(name, Counter()).update(examples=1, **counts)


def run_property(name: str, prop: Callable[[], None]) -> None:
    """Run a hypothesis property and record its figures; an uncaught exception fails the test."""
    TALLY[name] = Counter()
    try:
        prop()
    except BaseException:
        record("bad_input", {name: {**_figures(name), "uncaught": 1}})
        raise
    record("bad_input", {name: {**_figures(name), "uncaught": 0}})


def _figures(name: str) -> dict[str, int]:
    counts = TALLY[name]
    return {k: counts[k] for k in ("examples", "refusals", "quarantined")}


@contextmanager
def scratch() -> Iterator[Path]:
    # A fresh directory per example: hypothesis cannot use function-scoped fixtures per example.
    with tempfile.TemporaryDirectory(prefix="lmpipe-bad-input-") as name:
        yield Path(name)


# ----------------------------------------------------------------------------------- strategies

_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)


def _scalars(finite: bool) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=not finite, allow_infinity=not finite),
        _TEXT,
    )


_SCALARS = _scalars(finite=False)
_FINITE_SCALARS = _scalars(finite=True)  # json.dumps would write NaN/Infinity, not JSON


def _field_names(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[str]:
    """Every field name of a pydantic model and of the models nested in it."""
    names: set[str] = set()
    if model in seen:
        return names
    seen.add(model)
    for name, info in model.model_fields.items():
        names.add(name)
        for arg in _types_in(info.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                names |= _field_names(arg, seen)
    return names


def _types_in(annotation: Any) -> Iterator[Any]:
    yield annotation
    for arg in getattr(annotation, "__args__", ()):
        yield from _types_in(arg)


RUN_KEYS = sorted(_field_names(RunConfig, set()))
DATASET_KEYS = sorted(_field_names(DatasetConfig, set()))


def documents(keys: list[str]) -> st.SearchStrategy[Any]:
    """YAML-able documents whose mapping keys are mostly real config keys."""
    key = st.one_of(st.sampled_from(keys), _TEXT)
    return st.recursive(
        _SCALARS,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(key, inner, max_size=5)
        ),
        max_leaves=20,
    )


def yaml_text(keys: list[str]) -> st.SearchStrategy[bytes]:
    """A YAML document as bytes: a dumped structure, raw text, or raw bytes."""
    dumped = documents(keys).map(lambda d: yaml.safe_dump(d, allow_unicode=True).encode())
    return st.one_of(dumped, _TEXT.map(str.encode), st.binary(max_size=200))


# ------------------------------------------------------------------------------- config loader

DEMO = REPO / "configs" / "demo.yaml"


def demo_recipe() -> dict[str, Any]:
    """The demo recipe with its task file made absolute (the tests do not depend on the cwd)."""
    data = read_recipe(DEMO)
    data["task"]["config"] = str(REPO / data["task"]["config"])
    return data


def _leaves(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf; an empty mapping or list is a leaf."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list) and node:
        for index, value in enumerate(node):
            yield from _leaves(value, f"{prefix}.{index}")
    else:
        yield prefix, node


_DEMO = dict(_leaves(load_config(DEMO).model_dump(mode="json", exclude={"task"}), ""))
DEMO_LEAVES = sorted(set(_DEMO) - {""})
# Empty mappings in the demo recipe are free-form (e.g. `finetune.deepspeed_extra`: extra
# DeepSpeed keys passed through): any key is allowed under them.
FREE_FORM = {key for key in DEMO_LEAVES if _DEMO[key] == {}}


def load_recipe(path: Path, overrides: list[str]) -> RunConfig | ConfigError:
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        return exc


def names_key(message: str, key: str) -> bool:
    """Whether `message` names `key` or one of its sections (a whole-section check)."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in message for n in range(len(parts), 0, -1))


def test_any_yaml_recipe_loads_or_is_refused_naming_the_file() -> None:
    @PROFILE
    @given(yaml_text(RUN_KEYS))
    @example(b"2001-13-01")  # yaml.safe_load raised ValueError (an impossible date)
    @example(b"seed: !!timestamp x")  # ... and AttributeError
    @example(b"seed: !!int abc")
    @example(b"\xff\xfe name: x")  # UnicodeDecodeError escaped read_recipe
    @example(b"[" * 5000)  # RecursionError in PyYAML's composer
    @example(b"task: {config: .}")  # IsADirectoryError escaped the task config loader
    def prop(text: bytes) -> None:
        with scratch() as tmp:
            path = tmp / "recipe.yaml"
            path.write_bytes(text)
            outcome = load_recipe(path, [])
        refused = isinstance(outcome, ConfigError)
        tally("config_yaml", refusals=int(refused))
        if refused:
            assert str(path) in str(outcome)

    run_property("config_yaml", prop)


def test_a_recipe_that_is_a_directory_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
        load_config(tmp_path)


_KEY = st.one_of(
    st.sampled_from(DEMO_LEAVES),
    st.builds(lambda a, b: f"{a}.{b}", st.sampled_from(DEMO_LEAVES), st.sampled_from(RUN_KEYS)),
    st.builds(lambda a, b: f"{a}.{b}", st.sampled_from(RUN_KEYS), st.sampled_from(RUN_KEYS)),
)
_VALUE = st.one_of(
    _SCALARS.map(lambda v: yaml.safe_dump(v, default_flow_style=True).removesuffix("\n...\n")),
    _TEXT,
    st.sampled_from(
        ["[]", "{}", "-1", "0", "1e309", ".nan", "2001-13-01", "!!int x", "[1, {a: 2}]"]
    ),
)
_OVERRIDE = st.one_of(st.builds(lambda k, v: f"{k}={v}", _KEY, _VALUE), _TEXT)


def test_any_override_applies_or_is_refused_naming_the_key() -> None:
    @PROFILE
    @given(st.lists(_OVERRIDE, min_size=1, max_size=3))
    @example(["name.x=1"])  # TypeError: the parent of the key was a str, not a section
    @example(["train.max_steps.x=1"])
    @example(["seed=2001-13-01"])  # ValueError from PyYAML's timestamp constructor
    @example(["ingest.sources.7.path=x"])  # an index past the end of a list
    @example(["task.config=."])  # a directory as the task file
    def prop(overrides: list[str]) -> None:
        with scratch() as tmp:
            path = tmp / "demo.yaml"
            path.write_text(yaml.safe_dump(demo_recipe()))
            outcome = load_recipe(path, overrides)
        refused = isinstance(outcome, ConfigError)
        tally("config_overrides", refusals=int(refused))
        if refused:
            message = str(outcome)
            keys = [o.partition("=")[0] for o in overrides]
            named = [o for o in overrides if o in message or repr(o) in message]
            assert named or any(names_key(message, k) for k in keys), message

    run_property("config_overrides", prop)


_WRONG = st.sampled_from(
    ["null", "-1", "-1000000", "0", "1e309", "-.inf", ".nan", "''", "x" * 300, "[]", "{}",
     "true", "[1, 2]", "{a: 1}", "99999999999999999999999"]
)  # fmt: skip


def test_wrong_types_unknown_keys_and_out_of_range_values_name_the_key() -> None:
    @PROFILE
    @given(st.sampled_from(DEMO_LEAVES), _WRONG, st.booleans())
    @example("train.max_steps", "-1", False)
    @example("ingest.sources.0.path", "[]", False)
    @example("train.optim.lr", "misspelt", True)
    @example("finetune.deepspeed_extra", "null", True)  # free-form: any key is allowed
    def prop(key: str, value: str, unknown: bool) -> None:
        override = f"{key}.no_such_key={value}" if unknown else f"{key}={value}"
        with scratch() as tmp:
            path = tmp / "demo.yaml"
            path.write_text(yaml.safe_dump(demo_recipe()))
            outcome = load_recipe(path, [override])
        refused = isinstance(outcome, ConfigError)
        tally("config_wrong_values", refusals=int(refused))
        if unknown and key not in FREE_FORM:  # a leaf has no keys: refused, naming the key
            assert refused
        if refused:
            assert names_key(str(outcome), key), str(outcome)

    run_property("config_wrong_values", prop)


def test_any_task_yaml_loads_or_is_refused_naming_the_file() -> None:
    @PROFILE
    @given(yaml_text(DATASET_KEYS))
    @example(b"name: x\ntask_type: regression\nsplits: {train: 2001-13-01}")
    @example(b"\xff")  # UnicodeDecodeError escaped load_dataset_config
    @example(
        b"name: x\ntask_type: classification\nsplits: {train: a.csv}\ndelimiter: ab\n"
        b"columns: {text: 0, label: 1}\nheader: false"
    )  # a 2-char delimiter: TypeError later
    def prop(text: bytes) -> None:
        with scratch() as tmp:
            path = tmp / "task.yaml"
            path.write_bytes(text)
            try:
                load_dataset_config(path)
                message = None
            except DatasetConfigError as exc:
                message = str(exc)
        tally("task_yaml", refusals=int(message is not None))
        assert message is None or str(path) in message

    run_property("task_yaml", prop)


# ------------------------------------------------------------------------------------ ingestion

#: The smallest record size limit the config allows: oversize lines are cheap to generate.
LIMIT = 1024


def ingest(path: Path, source: dict[str, Any], unit_mb: float = 32) -> dict[str, Any]:
    """Run the ingest stage's per-unit path (no Ray) on `path`: counts and quarantine rows.

    The same functions as `run_ingest`: expand, plan, `process_unit` per unit, exact dedup and
    `reconcile_counts` (which asserts read = kept + filtered + duplicates + quarantined).
    """
    cfg = IngestConfig(
        sources=[SourceConfig(path=str(path), **source)],
        max_record_bytes=LIMIT,
        unit_size_mb=unit_mb,
    )
    src = cfg.sources[0]
    files = expand_source(src, 0)
    units = plan_units(files, src.txt_mode, int(unit_mb * (1 << 20)), {src.display_name(): {}})
    out = path.parent / "out"
    (out / "_staging").mkdir(parents=True)
    summaries = [process_unit(UnitJob(u, cfg, str(out / "_staging"), {})) for u in units]
    keys = load_keys(out / "_staging", units, near=False)
    counts = reconcile_counts(summaries, None, dedup_documents(keys, cfg.dedup, None))
    write_quarantine(out, units, summaries, None)
    bad = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    texts = [
        t
        for u in units
        for t in read_ipc_stream(out / "_staging" / f"unit-{u.index:06d}.docs.arrow")
        .column("text")
        .to_pylist()
    ]
    return {"counts": counts, "bad": bad, "units": len(units), "texts": texts}


def ingest_or_refuse(path: Path, source: dict[str, Any]) -> dict[str, Any] | str:
    """`ingest`, or the message of its `InputError`, which must name the file."""
    try:
        return ingest(path, source)
    except InputError as exc:
        message = str(exc)
    assert str(path) in message, message
    return message


def accounted(counts: dict[str, Any]) -> int:
    return int(
        counts["kept"]
        + sum(counts["filtered"].values())
        + sum(counts["duplicates"].values())
        + sum(counts["quarantined"].values())
    )


def looks_binary(data: bytes) -> bool:
    """The documented rule: the first 8 KiB hold >1% NUL or >10% control bytes."""
    head = data[:8192]
    controls = sum(1 for b in head if b < 9 or 13 < b < 32)
    return bool(head) and (head.count(0) > len(head) // 100 or controls > len(head) // 10)


def ingest_lines(
    data: bytes, name: str, source: dict[str, Any], unit_mb: float, figure: str
) -> dict[str, Any]:
    """Ingest `data` as the line-based file `name`; check what holds for any such input.

    The counts reconcile, every quarantined record names the file and its line, an empty file
    is one `empty_file` record and a binary one a single `binary_file` record.
    """
    with scratch() as tmp:
        path = tmp / name
        path.write_bytes(data)
        result = ingest(path, source, unit_mb)
    counts = result["counts"]
    tally(figure, quarantined=len(result["bad"]))
    assert counts["read"] == accounted(counts)
    check_quarantine(result, name, line_based=True)
    if not data:
        assert counts["quarantined"] == {"empty_file": 1}
    elif looks_binary(data):
        assert counts["read"] == 1
        assert counts["quarantined"] == {"binary_file": 1}
    return result


def checked(
    result: dict[str, Any] | str, figure: str, name: str, line_based: bool
) -> dict[str, Any] | None:
    """The counts of an ingest result after the checks any result passes; None for a refusal."""
    if isinstance(result, str):
        tally(figure, refusals=1)
        return None
    counts: dict[str, Any] = result["counts"]
    tally(figure, quarantined=len(result["bad"]))
    assert counts["read"] == accounted(counts)
    check_quarantine(result, name, line_based)
    return counts


def check_quarantine(result: dict[str, Any], name: str, line_based: bool) -> None:
    """Every quarantined record names its file, and its line where the format has lines."""
    for row in result["bad"]:
        assert row["source_file"] == name
        if line_based and row["reason"] not in ("binary_file", "empty_file"):
            assert row["line"] is not None, row
            assert row["line"] >= 1, row


#: JSON Lines records by kind, and the quarantine reason each must get (None: a good record).
JSONL_KINDS: dict[str, tuple[st.SearchStrategy[bytes], str | None]] = {
    "good": (_TEXT.map(lambda t: json.dumps({"text": t}).encode()), None),
    "good_unicode": (
        _TEXT.map(lambda t: json.dumps({"text": t}, ensure_ascii=False).encode()),
        None,
    ),
    "no_field": (
        _FINITE_SCALARS.map(lambda v: json.dumps({"other": v}).encode()),
        "missing_field",
    ),
    # json.dumps writes NaN/Infinity, which JSON does not allow: the reader refuses the line.
    "non_finite": (
        st.sampled_from([b'{"text": "a", "x": NaN}', b'{"other": Infinity}']),
        "malformed_json",
    ),
    "null": (st.just(b'{"text": null}'), "missing_field"),
    "not_object": (st.sampled_from([b"[1, 2]", b'"text"', b"3", b"true"]), "missing_field"),
    "wrong_type": (
        st.sampled_from(
            [b'{"text": 1}', b'{"text": ["a"]}', b'{"text": {"a": 1}}', b'{"text": false}']
        ),
        "wrong_type",
    ),
    "malformed": (
        st.sampled_from([b"{", b'{"text": "a"', b"nope", b"{'text': 'a'}", b"[" * 1000]),
        "malformed_json",
    ),
    "bad_utf8": (
        _TEXT.map(lambda t: b'{"text": "' + json.dumps(t)[1:-1].encode() + b'\xff\xfe"}'),
        "invalid_utf8",
    ),
    "nul": (st.just(b'{"text": "a\x00b"}'), "nul_byte"),
    "huge": (
        st.integers(LIMIT + 1, 3 * LIMIT).map(lambda n: json.dumps({"text": "w " * n}).encode()),
        "record_too_large",
    ),
    "blank": (st.sampled_from([b"", b"   ", b"\t", b"\r"]), "blank"),
}
_JSONL_LINE = st.sampled_from(sorted(JSONL_KINDS)).flatmap(
    lambda kind: JSONL_KINDS[kind][0].map(lambda raw: (kind, raw))
)


def test_jsonl_records_are_kept_or_quarantined_at_their_line() -> None:
    @PROFILE
    @given(
        st.lists(_JSONL_LINE, max_size=30),
        st.booleans(),
        st.booleans(),
        st.sampled_from([0.001, 32]),
    )
    @example([("good", b'{"text": "a"}')], True, True, 32)  # BOM and CRLF
    @example([("blank", b""), ("good", b'{"text": "a"}')], True, False, 32)  # a BOM-only line
    @example([("malformed", b"[" * 1000)], False, False, 32)
    def prop(lines: list[tuple[str, bytes]], bom: bool, crlf: bool, unit_mb: float) -> None:
        eol = b"\r\n" if crlf else b"\n"
        data = (b"\xef\xbb\xbf" if bom else b"") + eol.join(raw for _, raw in lines)
        result = ingest_lines(data, "in.jsonl", {"format": "jsonl"}, unit_mb, "ingest_jsonl")
        counts, bad = result["counts"], result["bad"]
        if data and not looks_binary(data):
            records = [(n, kind) for n, (kind, raw) in enumerate(lines, 1) if raw.strip()]
            if bom and not lines:  # the file is only a BOM: blank
                records = []
            assert counts["read"] == len(records)  # nothing lost, nothing invented
            expected = Counter(JSONL_KINDS[k][1] for _, k in records if JSONL_KINDS[k][1])
            assert Counter(counts["quarantined"]) == expected
            # The file's own line numbers, however many work units it was cut into.
            want = sorted((n, JSONL_KINDS[k][1]) for n, k in records if JSONL_KINDS[k][1])
            assert sorted((r["line"], r["reason"]) for r in bad) == want

    run_property("ingest_jsonl", prop)


def _oracle_txt(data: bytes, mode: str) -> int:
    """Records the documented cutting rule finds in a text file (blank ones are not records)."""
    data = data.removeprefix(b"\xef\xbb\xbf")  # a BOM is not text
    if mode == "line":
        parts = data.split(b"\n")
    elif mode == "block":
        parts = re.split(rb"\n(?:[ \t\r\f\v]*\n)+", data)
    else:
        parts = [data]
    return sum(1 for part in parts if part.strip())


_TXT_PIECES = st.one_of(
    _TEXT.map(str.encode),
    st.sampled_from(
        [b"\n", b"\n\n", b"\r\n", b" \n \n", b"\xef\xbb\xbf", b"\x00", b"\xff", b"\xc3"]
    ),
    st.binary(max_size=20),
    st.integers(LIMIT + 1, 2 * LIMIT).map(lambda n: b"x" * n),
)


def test_text_files_are_cut_into_exactly_the_records_written() -> None:
    @PROFILE
    @given(
        st.lists(_TXT_PIECES, max_size=40).map(b"".join),
        st.sampled_from(["line", "block", "file"]),
        st.sampled_from([0.001, 32]),
    )
    @example(b"\xef\xbb\xbfa\n\x00b\nc\xff\n", "line", 32)
    @example(b"\xc2\x85\xff", "line", 0.001)  # U+0085 in an excerpt: one quarantine line
    def prop(data: bytes, mode: str, unit_mb: float) -> None:
        source = {"format": "txt", "txt_mode": mode}
        result = ingest_lines(data, "in.txt", source, unit_mb, "ingest_txt")
        if data and not looks_binary(data):
            assert result["counts"]["read"] == _oracle_txt(data, mode)

    run_property("ingest_txt", prop)


_COMPRESSORS = {".gz": gzip.compress}


def test_truncated_or_corrupt_gzip_keeps_what_was_decoded_and_says_where_it_broke() -> None:
    @PROFILE
    @given(
        st.lists(_TEXT.filter(lambda t: t.strip()), min_size=1, max_size=200),
        st.sampled_from(["jsonl", "txt", "csv", "json"]),
        st.floats(0, 1),
        st.booleans(),
    )
    @example(["a", "b"], "csv", 0.5, False)  # compressed CSV: pyarrow needed `closed`
    @example(["0"], "json", 0.75, False)  # cut after the array's `]`: the trailer is lost
    @example(["0\x1f\U00010000"], "json", 0.4375, True)  # malformed JSON, then a broken stream
    @example(["Ô\x83", "Ô\x83", "P0"], "txt", 0.75, True)  # the flip decodes to other lines
    @example(["\U00059c00", "000\x1f\x1e03", "0"], "json", 0.75, True)  # bad UTF-8, then a break
    @example(["0\r0\r0"], "csv", 1.0, False)  # a bare CR inside a field
    def prop(texts: list[str], fmt: str, cut: float, flip: bool) -> None:
        data = _encode(texts, fmt)
        packed = gzip.compress(data)
        broken = bytearray(packed[: max(1, int(len(packed) * cut))])
        if flip:
            broken[len(broken) // 2] ^= 0xFF
        with scratch() as tmp:
            path = tmp / f"in.{fmt}.gz"
            path.write_bytes(bytes(broken))
            result = ingest_or_refuse(path, {"txt_mode": "line"})
        counts = checked(result, "ingest_gzip", path.name, line_based=fmt in ("jsonl", "txt"))
        if counts is None:  # a csv header that did not survive the cut
            return
        if bytes(broken) != packed:  # the break is reported, unless the whole file is refused
            reasons = {"truncated_compressed", "corrupt_compressed", "binary_file"}
            assert set(counts["quarantined"]) & reasons
        # A cut stream keeps a prefix of what was written: nothing out of order, nothing
        # invented. A flipped bit can make deflate decode other bytes before the CRC check at
        # the end fails: those records are kept, and the break is still reported (above).
        if not flip:
            assert counts["read"] <= len(texts) + 1

    run_property("ingest_gzip", prop)


def _encode(texts: list[str], fmt: str) -> bytes:
    if fmt == "jsonl":
        return b"\n".join(json.dumps({"text": t}).encode() for t in texts)
    if fmt == "json":
        return json.dumps([{"text": t} for t in texts]).encode()
    if fmt == "csv":
        buffer = io.StringIO()
        # QUOTE_ALL: the minimal quoting leaves a bare "\r" unquoted, which readers split on.
        writer = csv.writer(buffer, lineterminator="\n", quoting=csv.QUOTE_ALL)
        writer.writerow(["text"])
        writer.writerows([t] for t in texts)
        return buffer.getvalue().encode()
    return "\n".join(t.replace("\n", " ").replace("\r", " ") for t in texts).encode()


#: JSON array elements by kind, with the quarantine reason each must get (None: good).
ARRAY_KINDS: dict[str, tuple[st.SearchStrategy[Any], str | None]] = {
    "good": (_TEXT.map(lambda t: {"text": t}), None),
    "no_field": (_SCALARS.map(lambda v: {"other": v}), "missing_field"),
    "null": (st.just({"text": None}), "missing_field"),
    "not_object": (_SCALARS, "missing_field"),
    "wrong_type": (
        st.sampled_from([1, [1], {"a": 1}, True, 1.5]).map(lambda v: {"text": v}),
        "wrong_type",
    ),
}
_ELEMENT = st.sampled_from(sorted(ARRAY_KINDS)).flatmap(
    lambda kind: ARRAY_KINDS[kind][0].map(lambda value: (kind, value))
)


def test_json_array_elements_are_kept_or_quarantined_by_index() -> None:
    @PROFILE
    @given(st.lists(_ELEMENT, max_size=30), st.booleans())
    @example([("good", {"text": "a"})], True)  # a BOM quarantined the whole array
    def prop(elements: list[tuple[str, Any]], bom: bool) -> None:
        data = (b"\xef\xbb\xbf" if bom else b"") + json.dumps([v for _, v in elements]).encode()
        result = ingest_json(data, "ingest_json")
        assert result["counts"]["read"] == len(elements)
        want = sorted(
            (i, ARRAY_KINDS[k][1]) for i, (k, _) in enumerate(elements) if ARRAY_KINDS[k][1]
        )
        assert sorted((r["offset"], r["reason"]) for r in result["bad"]) == want

    run_property("ingest_json", prop)


def ingest_json(data: bytes, figure: str) -> dict[str, Any]:
    """Ingest `data` as a `.json` file; its counts reconcile and its quarantine names it."""
    with scratch() as tmp:
        path = tmp / "in.json"
        path.write_bytes(data)
        result = ingest(path, {"format": "json"})
    counts = checked(result, figure, "in.json", line_based=False)
    assert counts is not None
    return result


def _empty_array(data: bytes) -> bool:
    try:
        return bool(json.loads(data.decode("utf-8-sig")) == [])
    except (ValueError, RecursionError):
        return False


def test_json_garbage_is_quarantined_and_counted() -> None:
    @PROFILE
    @given(st.one_of(st.binary(max_size=300), _TEXT.map(lambda t: ("[" + t).encode())))
    @example(b'[{"text": 1' + b"1" * 5000 + b"}]")  # ValueError: int over 4300 digits
    @example(b"[" * 100_000)  # RecursionError
    @example(b"!\xc2\x85")  # U+0085 in the excerpt
    @example(b"[]")  # an empty array: no record, nothing lost
    @example(b"[]!")  # data after the array: quarantined, not dropped
    def prop(data: bytes) -> None:
        counts = ingest_json(data, "ingest_json_garbage")["counts"]
        if data.strip() and not _empty_array(data):  # something there is at least one record
            assert counts["read"] >= 1

    run_property("ingest_json_garbage", prop)


#: CSV rows by kind: (fields strategy, reason the `text` field must get; None: good).
_CSV_TEXT = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=30
)
CSV_KINDS: dict[str, tuple[st.SearchStrategy[list[str]], str | None]] = {
    "good": (st.tuples(_CSV_TEXT, _CSV_TEXT).map(list), None),
    "short": (_CSV_TEXT.filter(lambda t: t != "").map(lambda t: [t]), "malformed_csv"),
    "long": (st.tuples(_CSV_TEXT, _CSV_TEXT, _CSV_TEXT).map(list), "malformed_csv"),
}
_CSV_ROW = st.sampled_from(sorted(CSV_KINDS)).flatmap(
    lambda kind: CSV_KINDS[kind][0].map(lambda fields: (kind, fields))
)


def test_csv_and_tsv_rows_are_all_counted() -> None:
    @PROFILE
    @given(st.lists(_CSV_ROW, max_size=30), st.sampled_from(["csv", "tsv"]), st.booleans())
    @example([("good", ["a", "b"])], "csv", True)
    @example([("good", ["\x1f"]), ("good", ["\x1f\x08"])], "csv", False)  # binary-looking
    def prop(rows: list[tuple[str, list[str]]], fmt: str, bom: bool) -> None:
        sep = "," if fmt == "csv" else "\t"
        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter=sep, lineterminator="\n", quoting=csv.QUOTE_ALL)
        writer.writerow(["text", "other"])
        writer.writerows(fields for _, fields in rows)
        data = (b"\xef\xbb\xbf" if bom else b"") + buffer.getvalue().encode()
        with scratch() as tmp:
            path = tmp / f"in.{fmt}"
            path.write_bytes(data)
            result = ingest(path, {"format": fmt})
        counts = result["counts"]
        tally("ingest_csv", quarantined=len(result["bad"]))
        check_quarantine(result, f"in.{fmt}", line_based=False)
        if looks_binary(data):  # mostly control characters: the file is one binary record
            assert counts["read"] == 1
            assert counts["quarantined"] == {"binary_file": 1}
            return
        assert counts["read"] == accounted(counts) == len(rows)
        expected = Counter(CSV_KINDS[k][1] for k, _ in rows if CSV_KINDS[k][1])
        assert Counter(counts["quarantined"]) == expected

    run_property("ingest_csv", prop)


_COLUMNS = st.sampled_from(
    [pa.string(), pa.large_string(), pa.binary(), pa.int64(), pa.float64(), pa.list_(pa.string())]
)


def _cells(kind: pa.DataType) -> st.SearchStrategy[Any]:
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return st.one_of(st.none(), _TEXT)
    if pa.types.is_binary(kind):
        return st.one_of(st.none(), st.binary(max_size=20))
    if pa.types.is_integer(kind):
        return st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))
    if pa.types.is_floating(kind):
        return st.one_of(st.none(), st.floats())
    return st.one_of(st.none(), st.lists(_TEXT, max_size=3))


def _expected_parquet(kind: pa.DataType, value: Any) -> str | None:
    if value is None:
        return "missing_field"
    if pa.types.is_binary(kind):
        if b"\x00" in value:
            return "nul_byte"
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return "invalid_utf8"
        return None
    return None if isinstance(value, str) else "wrong_type"


def test_parquet_text_columns_of_any_type_are_kept_or_quarantined() -> None:
    @PROFILE
    @given(
        _COLUMNS.flatmap(lambda kind: st.tuples(st.just(kind), st.lists(_cells(kind), max_size=20)))
    )
    @example((pa.int64(), [1, 2]))  # ints reached pa.array(..., large_string): ArrowTypeError
    def prop(column: tuple[pa.DataType, list[Any]]) -> None:
        kind, values = column
        with scratch() as tmp:
            path = tmp / "in.parquet"
            pq.write_table(pa.table({"text": pa.array(values, kind)}), path, row_group_size=7)
            result = ingest(path, {})
        counts = result["counts"]
        tally("ingest_parquet", quarantined=len(result["bad"]))
        assert counts["read"] == accounted(counts) == len(values)
        expected = Counter(r for v in values if (r := _expected_parquet(kind, v)))
        assert Counter(counts["quarantined"]) == expected

    run_property("ingest_parquet", prop)


def test_random_bytes_in_any_format_are_refused_or_quarantined() -> None:
    @PROFILE
    @given(
        st.binary(max_size=400), st.sampled_from(["txt", "jsonl", "json", "csv", "tsv", "parquet"])
    )
    @example(b"PAR1garbagePAR1", "parquet")
    @example(b"\xff\xfe,x\na,b\n", "csv")
    def prop(data: bytes, fmt: str) -> None:
        with scratch() as tmp:
            path = tmp / f"in.{fmt}"
            path.write_bytes(data)
            result = ingest_or_refuse(path, {"text_field": "text"})
        # Refused before any work, naming the file, or counted: either is fine.
        checked(result, "ingest_random_bytes", path.name, line_based=fmt in ("txt", "jsonl"))

    run_property("ingest_random_bytes", prop)


# ------------------------------------------------------------------------------- downstream

LABELS = ["a", "b"]
_WORD = st.text("abcxyz XYZ019,.;:!?'\"-_", min_size=1, max_size=12).filter(lambda t: t.strip())


def dataset(fmt: str, name: str, skip: bool, **extra: Any) -> DatasetConfig:
    """A classification dataset over one train file (token_classification for conll)."""
    if fmt == "conll":
        return DatasetConfig(
            name="bad-input",
            task_type="token_classification",
            format="conll",
            splits={"train": name},
            labels=["O", "B-X"],
            on_bad_row="skip" if skip else "raise",
        )
    return DatasetConfig(
        name="bad-input",
        task_type="classification",
        format=fmt,  # type: ignore[arg-type]
        splits={"train": name},
        columns={"text": "text", "label": "label"},
        labels=LABELS,
        on_bad_row="skip" if skip else "raise",
        **extra,
    )


def load(cfg: DatasetConfig, base: Path) -> Any:
    try:
        return load_downstream(cfg, base)
    except DownstreamDataError as exc:
        return exc


def check_outcome(
    outcome: Any,
    path: Path,
    records: int | None,
    bad: set[int],
    first: int | None,
    skip: bool,
    prop: str,
) -> None:
    """A result whose counts match what was written, or a refusal naming the file and line."""
    if isinstance(outcome, DownstreamDataError):
        tally(prop, refusals=1)
        message = str(outcome)
        assert message.startswith(f"{path}: "), message
        if records is not None and not skip and first is not None:
            assert message.startswith(f"{path}: line {first}"), message
        elif records is not None:  # skipped every record, or there were none: an empty split
            assert len(bad) == records, message
        return
    tally(prop)
    counts = outcome.counts["train"]
    assert counts.read == counts.refused + counts.dropped + counts.kept
    if records is not None:
        assert (counts.read, counts.refused) == (records, len(bad))
        assert skip or not bad


#: JSON Lines records by kind: a raw line, and whether the record is bad (None: not a record).
DS_JSONL: dict[str, tuple[st.SearchStrategy[bytes], bool | None]] = {
    "good": (
        st.tuples(_WORD, st.sampled_from(LABELS)).map(
            lambda p: json.dumps({"text": p[0], "label": p[1]}).encode()
        ),
        False,
    ),
    "blank_text": (st.just(b'{"text": "  ", "label": "a"}'), True),
    "unknown_label": (
        _WORD.map(lambda w: json.dumps({"text": "t", "label": w + "?"}).encode()),
        True,
    ),
    "missing": (st.just(b'{"label": "a"}'), True),
    "wrong_type": (
        st.sampled_from([b'{"text": ["x"], "label": "a"}', b'{"text": "x", "label": null}']),
        True,
    ),
    "not_object": (st.sampled_from([b"[1]", b"2", b'"x"', b"NaN"]), True),
    "invalid": (st.sampled_from([b"{", b"{'text': 1}", b"[" * 5000]), True),
    "bigint": (st.just(b'{"text": "x", "label": ' + b"1" * 5000 + b"}"), True),
    "blank": (st.sampled_from([b"", b"  ", b"\t"]), None),
}
_DS_LINE = st.sampled_from(sorted(DS_JSONL)).flatmap(
    lambda kind: DS_JSONL[kind][0].map(lambda raw: (kind, raw))
)


def test_downstream_jsonl_records_are_counted_or_refused_at_their_line() -> None:
    @PROFILE
    @given(st.lists(_DS_LINE, max_size=25), st.booleans(), st.booleans(), st.integers(0, 30))
    @example(
        [("bigint", b'{"text": "x", "label": ' + b"1" * 5000 + b"}")], True, False, 0
    )  # ValueError escaped
    @example([("good", b'{"text": "x", "label": "a"}')], False, False, 1)  # invalid UTF-8 at line 1
    def prop(lines: list[tuple[str, bytes]], skip: bool, bom: bool, bad_utf8_at: int) -> None:
        raws = [raw for _, raw in lines]
        utf8_line = None
        if 0 < bad_utf8_at <= len(raws):  # a byte that is not UTF-8 refuses the whole file
            raws[bad_utf8_at - 1] += b"\xff"
            utf8_line = bad_utf8_at
        data = (b"\xef\xbb\xbf" if bom else b"") + b"\n".join(raws)
        numbered = [(n, DS_JSONL[k][1]) for n, (k, _) in enumerate(lines, 1)]
        records = [(n, is_bad) for n, is_bad in numbered if is_bad is not None]
        bad = {n for n, is_bad in records if is_bad}
        with scratch() as tmp:
            path = tmp / "train.jsonl"
            path.write_bytes(data)
            outcome = load(dataset("jsonl", path.name, skip), tmp)
        if utf8_line is not None:
            assert isinstance(outcome, DownstreamDataError)
            assert str(outcome).startswith(f"{path}: line {utf8_line} column"), str(outcome)
            tally("downstream_jsonl", refusals=1)
            return
        check_outcome(
            outcome, path, len(records), bad, min(bad, default=None), skip, "downstream_jsonl"
        )

    run_property("downstream_jsonl", prop)


_CSV_FIELD = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00\r"), max_size=12
)
DS_CSV: dict[str, tuple[st.SearchStrategy[list[str]], bool | None]] = {
    "good": (
        st.tuples(_CSV_FIELD.filter(lambda t: t.strip()), st.sampled_from(LABELS)).map(list),
        False,
    ),
    "blank_text": (st.just(["  ", "a"]), True),
    "unknown_label": (st.tuples(_WORD, _WORD.map(lambda w: w + "?")).map(list), True),
    "short": (_WORD.map(lambda w: [w]), True),
    "long": (st.tuples(_WORD, st.sampled_from(LABELS), _CSV_FIELD).map(list), True),
    "blank": (st.just([]), None),
}
_DS_ROW = st.sampled_from(sorted(DS_CSV)).flatmap(
    lambda kind: DS_CSV[kind][0].map(lambda fields: (kind, fields))
)


def _rows_text(rows: list[list[str]], fmt: str) -> tuple[str, list[int]]:
    """The file text and each row's first line (header on line 1)."""
    out, lines, line = ["text,label\n" if fmt == "csv" else "text\tlabel\n"], [], 2
    for fields in rows:
        if fmt == "csv":
            buffer = io.StringIO()
            csv.writer(buffer, lineterminator="\n").writerow(fields)
            text = buffer.getvalue()
        else:  # tsv: no quoting, so no tab or line break inside a field
            text = "\t".join(f.replace("\t", " ").replace("\n", " ") for f in fields) + "\n"
        out.append(text)
        lines.append(line)
        line += text.count("\n")
    return "".join(out), lines


def test_downstream_csv_and_tsv_rows_are_counted_or_refused_at_their_line() -> None:
    @PROFILE
    @given(st.lists(_DS_ROW, max_size=25), st.sampled_from(["csv", "tsv"]), st.booleans())
    @example([("good", ["multi\nline", "a"]), ("short", ["x"])], "csv", False)
    def prop(rows: list[tuple[str, list[str]]], fmt: str, skip: bool) -> None:
        text, lines = _rows_text([fields for _, fields in rows], fmt)
        kinds = [(line, DS_CSV[kind][1]) for line, (kind, _) in zip(lines, rows, strict=True)]
        records = [(line, is_bad) for line, is_bad in kinds if is_bad is not None]
        bad = {line for line, is_bad in records if is_bad}
        with scratch() as tmp:
            path = tmp / f"train.{fmt}"
            path.write_text(text, encoding="utf-8")
            outcome = load(dataset(fmt, path.name, skip), tmp)
        check_outcome(
            outcome, path, len(records), bad, min(bad, default=None), skip, "downstream_csv"
        )

    run_property("downstream_csv", prop)


_TAG = st.sampled_from(["O", "B-X", "zz"])
_SENTENCE = st.lists(
    st.tuples(_WORD.map(lambda w: w.replace(" ", "_")), _TAG), min_size=1, max_size=4
)


def test_downstream_conll_sentences_are_counted_or_refused_at_their_first_line() -> None:
    @PROFILE
    @given(st.lists(_SENTENCE, max_size=10), st.booleans(), st.booleans())
    def prop(sentences: list[list[tuple[str, str]]], skip: bool, docstart: bool) -> None:
        out, line, starts, bad = (
            ["-DOCSTART- -X- O\n\n"] if docstart else [],
            3 if docstart else 1,
            [],
            set(),
        )
        for sentence in sentences:
            starts.append(line)
            if any(tag == "zz" for _, tag in sentence):
                bad.add(line)
            out += [f"{token} {tag}\n" for token, tag in sentence] + ["\n"]
            line += len(sentence) + 1
        with scratch() as tmp:
            path = tmp / "train.txt"
            path.write_text("".join(out))
            outcome = load(dataset("conll", path.name, skip), tmp)
        check_outcome(
            outcome, path, len(starts), bad, min(bad, default=None), skip, "downstream_conll"
        )

    run_property("downstream_conll", prop)


_FORMATS = ["csv", "tsv", "jsonl", "json", "conll", "parquet"]


def test_downstream_random_bytes_in_any_format_are_refused_naming_the_file() -> None:
    @PROFILE
    @given(st.binary(max_size=300), st.sampled_from(_FORMATS), st.booleans())
    @example(b"PAR1garbagePAR1", "parquet", False)  # ArrowInvalid escaped read_parquet
    @example(b"[" * 100_000, "json", False)  # RecursionError escaped read_json
    @example(b"a b\n\xff c\n", "conll", True)
    def prop(data: bytes, fmt: str, skip: bool) -> None:
        with scratch() as tmp:
            path = tmp / f"train.{'txt' if fmt == 'conll' else fmt}"
            path.write_bytes(data)
            outcome = load(dataset(fmt, path.name, skip), tmp)
        check_outcome(outcome, path, None, set(), None, skip, "downstream_random_bytes")

    run_property("downstream_random_bytes", prop)


def test_downstream_parquet_columns_of_any_type_are_counted_or_refused() -> None:
    @PROFILE
    @given(
        _COLUMNS.flatmap(
            lambda kind: st.tuples(st.just(kind), st.lists(_cells(kind), max_size=15))
        ),
        st.booleans(),
    )
    @example((pa.string(), [None, "0"]), False)  # refused at its first bad row, by number
    def prop(column: tuple[pa.DataType, list[Any]], skip: bool) -> None:
        kind, values = column
        labels = ["a" if i % 2 else "b" for i in range(len(values))]
        with scratch() as tmp:
            path = tmp / "train.parquet"
            pq.write_table(pa.table({"text": pa.array(values, kind), "label": labels}), path)
            outcome = load(dataset("parquet", path.name, skip), tmp)
        ok = [isinstance(v, str) and bool(v.strip()) for v in values]
        first_bad = ok.index(False) if False in ok else None
        if isinstance(outcome, DownstreamDataError) and not skip and first_bad is not None:
            tally("downstream_parquet", refusals=1)  # the first bad row, named by its number
            assert str(outcome).startswith(f"{path}: row {first_bad + 1}: "), str(outcome)
            return
        bad = set(range(len(values) - sum(ok)))  # only the count matters here
        check_outcome(outcome, path, len(values), bad, None, skip, "downstream_parquet")

    run_property("downstream_parquet", prop)


def test_a_multi_character_csv_delimiter_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="delimiter"):
        dataset("csv", "a.csv", False, delimiter="ab")
