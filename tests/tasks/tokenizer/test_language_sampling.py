"""XLM-R-style language sampling: the q formula, the seeded plan, the tokenizer stage, real data."""

import itertools
import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer

from tasks.common import schema
from tasks.common.io import fingerprint, write_ipc_stream, write_json_atomic
from tasks.common.stage import file_entry
from tasks.tokenizer.language_sampling import (
    LanguageSamplingConfig,
    sample_languages,
    temperature_shares,
)
from tasks.tokenizer.stage import run_tokenizer, tokenizer_task
from tasks.tokenizer.tokenizer import TokenizerConfig


def corpus(docs: dict[str, list[str]]) -> pa.Table:
    """A `source`/`text` table, sources interleaved so no language is one contiguous block."""
    rows = [(s, t) for s, texts in docs.items() for t in texts]
    rows = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    return pa.table(
        {
            schema.SOURCE: pa.array([s for s, _ in rows], pa.string()),
            schema.TEXT: pa.array([t for _, t in rows], pa.large_string()),
        }
    )


def synthetic_docs(seed: int = 1) -> dict[str, list[str]]:
    """Unbalanced: 400 long `big` documents, 40 `mid`, 6 short `small`."""
    rng = np.random.default_rng(seed)

    def docs(n: int, word: str, low: int, high: int) -> list[str]:
        return [" ".join([word] * int(rng.integers(low, high))) for _ in range(n)]

    return {
        "big": docs(400, "alpha", 20, 80),
        "mid": docs(40, "beta", 10, 60),
        "small": docs(6, "gamma", 5, 30),
    }


def write_ingest_output(root: Path, table: pa.Table, shards: int = 2) -> Path:
    """Write `table` as an ingest-format output (the layout `run_ingest` writes), no Ray needed."""
    root.mkdir(parents=True)
    n = table.num_rows
    full = pa.table(
        {
            schema.DOC_ID: pa.array([f"d{i}" for i in range(n)]),
            schema.SOURCE: table.column(schema.SOURCE),
            schema.SOURCE_FILE: pa.array(["corpus.txt"] * n),
            schema.OFFSET: pa.array(range(n), pa.int64()),
            schema.LINE: pa.array([None] * n, pa.int64()),
            schema.TEXT: table.column(schema.TEXT),
            schema.SENTENCES: pa.array([[t] for t in table.column(schema.TEXT).to_pylist()]),
        },
        schema=schema.DOCUMENTS,
    )
    entries = []
    bounds = np.linspace(0, n, shards + 1).astype(int)
    for i, (start, stop) in enumerate(itertools.pairwise(bounds)):
        path = root / f"train-{i:05d}.arrow"
        write_ipc_stream(full.slice(start, stop - start), path)
        entries.append(file_entry(root, path) | {"rows": int(stop - start)})
    manifest = {
        "stage": "ingest",
        "fingerprint": fingerprint([e["sha256"] for e in entries]),
        "splits": {"train": {"rows": n, "shards": entries}},
    }
    write_json_atomic(root / "manifest.json", manifest)
    return root


# --- the q formula ---------------------------------------------------------------------------


def test_alpha_one_keeps_the_natural_shares() -> None:
    q = temperature_shares({"en": 900, "ro": 90, "de": 10}, 1.0)
    assert q == pytest.approx({"en": 0.9, "ro": 0.09, "de": 0.01})


def test_alpha_zero_is_uniform_over_languages_with_data() -> None:
    q = temperature_shares({"en": 900, "ro": 90, "de": 10, "empty": 0}, 0.0)
    assert q == pytest.approx({"en": 1 / 3, "ro": 1 / 3, "de": 1 / 3, "empty": 0.0})


def test_alpha_half_matches_the_worked_example() -> None:
    # p = (0.9, 0.09, 0.01); sqrt p = (0.948683, 0.3, 0.1), sum 1.348683; q = sqrt p / sum
    q = temperature_shares({"a": 90, "b": 9, "c": 1}, 0.5)
    assert q == pytest.approx({"a": 0.703414, "b": 0.222439, "c": 0.074146}, abs=1e-6)


def test_a_smaller_alpha_lifts_the_smallest_language_monotonically() -> None:
    counts = {"en": 1_000_000, "sw": 1_000}
    lifted = [temperature_shares(counts, a)["sw"] for a in (1.0, 0.7, 0.5, 0.3, 0.0)]
    assert lifted == sorted(lifted)
    assert lifted[-1] == pytest.approx(0.5)


# --- the plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1.0, 0.7, 0.3, 0.0])
def test_realised_character_shares_are_within_a_point_of_the_target(alpha: float) -> None:
    plan = sample_languages(corpus(synthetic_docs()), LanguageSamplingConfig(alpha=alpha))
    for share in plan.languages.values():
        assert share.realised_share == pytest.approx(share.target_share, abs=0.01)
    total = sum(s.sampled_units for s in plan.languages.values())
    assert total == pytest.approx(plan.budget_units, rel=0.01)  # default budget: the corpus


def test_document_unit_realises_whole_documents_exactly_within_the_budget() -> None:
    cfg = LanguageSamplingConfig(alpha=0.3, unit="documents")
    plan = sample_languages(corpus(synthetic_docs()), cfg, budget_units=200)
    assert len(plan.rows) == plan.budget_units == 200
    for share in plan.languages.values():
        assert share.sampled_documents == share.sampled_units
        assert abs(share.sampled_documents - 200 * share.target_share) < 1


def test_a_language_below_its_target_is_upsampled_by_repeating_documents() -> None:
    table = corpus(synthetic_docs())
    plan = sample_languages(table, LanguageSamplingConfig(alpha=0.3))
    small = plan.languages["small"]
    assert small.sampled_documents > 3 * small.documents  # every document repeated
    sources = np.array(table.column(schema.SOURCE).to_pylist())[plan.rows]
    assert (sources == "small").sum() == small.sampled_documents
    assert len(np.unique(plan.rows)) < len(plan.rows)
    assert np.all(np.diff(plan.rows) >= 0)  # sorted, so the stage streams shard by shard


def test_a_character_budget_is_honoured() -> None:
    cfg = LanguageSamplingConfig(alpha=0.5, sample_characters=20_000)
    plan = sample_languages(corpus(synthetic_docs()), cfg, budget_units=cfg.sample_characters)
    assert sum(s.sampled_units for s in plan.languages.values()) == pytest.approx(20_000, rel=0.02)


def test_the_plan_is_deterministic_by_seed() -> None:
    table = corpus(synthetic_docs())
    first = sample_languages(table, LanguageSamplingConfig(alpha=0.3, seed=7))
    again = sample_languages(table, LanguageSamplingConfig(alpha=0.3, seed=7))
    other = sample_languages(table, LanguageSamplingConfig(alpha=0.3, seed=8))
    assert np.array_equal(first.rows, again.rows)
    assert first.report() == again.report()
    assert not np.array_equal(first.rows, other.rows)


def test_sources_mapped_to_one_language_are_counted_together() -> None:
    docs = synthetic_docs()
    cfg = LanguageSamplingConfig(alpha=0.0, languages={"big": "xx", "mid": "xx"})
    plan = sample_languages(corpus(docs), cfg)
    assert sorted(plan.languages) == ["small", "xx"]
    assert plan.languages["xx"].sources == ("big", "mid")
    assert plan.languages["xx"].documents == len(docs["big"]) + len(docs["mid"])
    assert plan.languages["small"].target_share == pytest.approx(0.5)
    assert json.loads(json.dumps(plan.report()))["languages"]["xx"]["sources"] == ["big", "mid"]


# --- refusals --------------------------------------------------------------------------------


def test_a_language_mapping_for_a_source_not_in_the_corpus_is_refused() -> None:
    cfg = LanguageSamplingConfig(languages={"big": "en", "wikipedia_ro": "ro"})
    with pytest.raises(ValueError, match=r"language_sampling\.languages.*'wikipedia_ro'"):
        sample_languages(corpus(synthetic_docs()), cfg)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, math.nan])
def test_alpha_out_of_range_is_refused_naming_the_key(alpha: float) -> None:
    with pytest.raises(ValidationError, match=r"language_sampling\.alpha\n.*between 0"):
        TokenizerConfig(language_sampling={"alpha": alpha})


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"language_sampling": {"unit": "documents", "sample_characters": 10}}, "sample_documents"),
        ({"language_sampling": {}, "sample_documents": 10}, "sample_characters"),
        ({"language_sampling": {}, "pretrained": {"tokenizer_json": "t.json"}}, "pretrained"),
        ({"language_sampling": {"languages": {"wmt": ""}}}, "must not be empty"),
        ({"language_sampling": {"temperature": 3}}, r"language_sampling\.temperature"),
    ],
)
def test_inconsistent_sampling_settings_are_refused(section: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        TokenizerConfig.model_validate(section)


# --- the tokenizer stage ---------------------------------------------------------------------


def test_tokenizer_stage_records_the_shares_and_keys_its_output_on_the_sampling(
    tmp_path: Path,
) -> None:
    ingest = write_ingest_output(tmp_path / "ingest", corpus(synthetic_docs()))
    base = {"family": "bpe", "vocab_size": 300, "min_frequency": 1}
    sampled = TokenizerConfig(**base, language_sampling={"alpha": 0.3})
    first = run_tokenizer(sampled, ingest, tmp_path / "ws")
    recorded = first.manifest["language_sampling"]
    assert recorded["alpha"] == 0.3
    assert recorded["unit"] == "characters"
    small = recorded["languages"]["small"]
    assert small["natural_share"] < 0.01 < small["target_share"]
    assert small["realised_share"] == pytest.approx(small["target_share"], abs=0.01)
    metrics = first.manifest["metrics"]
    assert metrics["language.small.realised_share"] == pytest.approx(
        small["realised_share"], abs=1e-6
    )
    sampled_docs = sum(s["sampled_documents"] for s in recorded["languages"].values())
    assert metrics["documents"] == sampled_docs  # the trainer saw exactly the planned rows
    assert run_tokenizer(sampled, ingest, tmp_path / "ws").reused
    fingerprints = {first.manifest["fingerprint"]}
    for other in [
        TokenizerConfig(**base, language_sampling={"alpha": 0.5}),
        TokenizerConfig(**base, language_sampling={"alpha": 0.3, "seed": 1}),
        TokenizerConfig(**base),
    ]:
        result = run_tokenizer(other, ingest, tmp_path / "ws")
        assert not result.reused
        fingerprints.add(result.manifest["fingerprint"])
    assert len(fingerprints) == 4
    assert "language_sampling" not in result.manifest  # off: the corpus as it is


def test_tokenizer_stage_reuse_sweeps_what_interrupted_work_left_inside_the_output(
    tmp_path: Path,
) -> None:
    ingest = write_ingest_output(tmp_path / "ingest", corpus(synthetic_docs()))
    cfg = TokenizerConfig(family="bpe", vocab_size=300, min_frequency=1)
    first = run_tokenizer(cfg, ingest, tmp_path / "ws")
    listed = {p.name: p.read_bytes() for p in first.path.iterdir()}
    (first.path / "_staging").mkdir()
    (first.path / ".tokenizer.json.tmp-999999-0123abcd").write_bytes(b"half a file")
    second = run_tokenizer(cfg, ingest, tmp_path / "ws")
    assert second.reused
    assert {p.name: p.read_bytes() for p in second.path.iterdir()} == listed


def test_tokenizer_task_logs_each_languages_realised_share(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = logging.getLogger("lmpipe.test.tokenizer_task")
    monkeypatch.setattr("tasks.tokenizer.stage.get_run_logger", lambda: logger)
    ingest = write_ingest_output(tmp_path / "ingest", corpus(synthetic_docs()))
    cfg = TokenizerConfig(family="bpe", vocab_size=300, language_sampling={"alpha": 0.0})
    with caplog.at_level("INFO", logger=logger.name):
        summary = tokenizer_task.fn(cfg, str(ingest), str(tmp_path / "ws"))
    assert summary["stage"] == "tokenizer" and not summary["reused"]  # noqa: PT018
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("language ")]
    assert len(lines) == 3
    assert all("target 0.3333" in line for line in lines)


# --- real mixed-language data ----------------------------------------------------------------


def _wmt(root: Path, name: str, lang: str) -> list[str]:
    lines = (root / "hf_tests_samples" / "wmt_en_ro" / name).read_text(encoding="utf-8")
    return [json.loads(line)["translation"][lang] for line in lines.splitlines() if line.strip()]


def _germeval(root: Path, name: str) -> list[str]:
    """GermEval's `token tag` lines, blank-line separated, joined back into sentences."""
    text = (root / "hf_tests_samples" / "GermEval" / name).read_text(encoding="utf-8")
    blocks = re.split(r"\n\s*\n", text.strip())
    return [" ".join(line.split(" ")[0] for line in block.splitlines()) for block in blocks]


def _gutenberg(root: Path, *books: str) -> list[str]:
    docs = []
    for book in books:
        text = (root / "gutenberg_books" / book).read_text(encoding="utf-8-sig")
        docs += [" ".join(b.split()) for b in re.split(r"\n\s*\n", text) if b.strip()]
    return docs


def tokens_per_word(tok: Tokenizer, docs: list[str]) -> float:
    encodings = tok.encode_batch(docs, add_special_tokens=False)
    return sum(len(e.ids) for e in encodings) / sum(len(d.split()) for d in docs)


@pytest.mark.slow
def test_xlmr_alpha_gives_low_resource_languages_fewer_tokens_per_word(
    shared_data: Path, tmp_path: Path
) -> None:
    # English ~822k characters, Romanian ~17k (2.0%), German ~1.3k (0.15%).
    docs = {
        "gutenberg": _gutenberg(
            shared_data, "devils_dictionary_972.txt", "news_from_nowhere_3261.txt"
        ),
        "wmt_en": _wmt(shared_data, "train.json", "en") + _wmt(shared_data, "val.json", "en"),
        "wmt_ro": _wmt(shared_data, "train.json", "ro") + _wmt(shared_data, "val.json", "ro"),
        "germeval": _germeval(shared_data, "train.txt"),
    }
    ingest = write_ingest_output(tmp_path / "ingest", corpus(docs), shards=3)
    held_out = {
        "ro": _wmt(shared_data, "test.json", "ro"),
        "de": _germeval(shared_data, "dev.txt"),
        "en": _wmt(shared_data, "test.json", "en"),
    }
    languages = {"gutenberg": "en", "wmt_en": "en", "wmt_ro": "ro", "germeval": "de"}
    measured: dict[float, dict[str, float]] = {}
    for alpha in (1.0, 0.3):
        cfg = TokenizerConfig(
            family="bpe",
            vocab_size=2000,
            lowercase=False,
            language_sampling={"alpha": alpha, "languages": languages},
        )
        result = run_tokenizer(cfg, ingest, tmp_path / "ws")
        tok = Tokenizer.from_file(str(result.path / "tokenizer.json"))
        measured[alpha] = {k: tokens_per_word(tok, v) for k, v in held_out.items()}
        shares = result.manifest["language_sampling"]["languages"]
        measured[alpha] |= {f"q_{k}": v["realised_share"] for k, v in shares.items()}
    print(f"held-out tokens per word and realised shares by alpha: {measured}")
    assert measured[1.0]["q_ro"] == pytest.approx(0.020, abs=0.002)  # the natural mix
    assert measured[0.3]["q_ro"] > 0.2
    assert measured[0.3]["ro"] < 0.92 * measured[1.0]["ro"]
    assert measured[0.3]["de"] < 0.92 * measured[1.0]["de"]
    assert measured[0.3]["en"] < 1.15 * measured[1.0]["en"]  # the price for English stays small
