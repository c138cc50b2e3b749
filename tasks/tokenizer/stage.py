"""The tokenizer stage: train (or load) the configured tokenizer and save it for `transformers`.

Layout of one output, `<workspace>/tokenizer/<fingerprint>/`: the files of
`PreTrainedTokenizerFast.save_pretrained` (`tokenizer.json`, `tokenizer_config.json`, ...) and
`manifest.json`. The directory is built under a temp name and renamed when complete. The
fingerprint covers the ingest output it trains on (or the bytes of your own files), the config
(`language_sampling` included) and the code, so the same corpus and config reuse the output.
With `language_sampling` the trainer sees an XLM-R-style mix by language
(tasks/tokenizer/language_sampling.py), and the manifest records each language's natural share,
target and realised share.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from prefect import get_run_logger
from tokenizers import Tokenizer

from tasks.common import schema
from tasks.common.caching import refresh_requested, stage_task
from tasks.common.io import public_dump, read_ipc_stream, safe_join, sha256_file
from tasks.common.stage import (
    StageOutput,
    StageResult,
    complete_manifest,
    file_entry,
    plan_output,
    read_upstream,
    shards_of,
    verify_shards,
)
from tasks.tokenizer.language_sampling import LanguageSample, sample_languages
from tasks.tokenizer.tokenizer import (
    TRAINER_VERSION,
    TokenizerConfig,
    load_tokenizer_files,
    padded_vocab_size,
    sentinels,
    special_tokens,
    to_transformers,
    train_tokenizer,
)

STAGE = "tokenizer"
TRAIN_SPLIT = "train"
_BATCH_ROWS = 1000


def sample_rows(total: int, sample: int | None) -> np.ndarray | None:
    """Row numbers of `sample` documents evenly spaced over `total`; None means all of them."""
    if sample is None or sample >= total:
        return None
    return (np.arange(sample, dtype=np.int64) * total) // sample


def language_plan(
    ingest_dir: Path, manifest: dict[str, Any], cfg: TokenizerConfig
) -> LanguageSample:
    """Plan the train split's rows by language (`cfg.language_sampling`), over all its shards.

    The shards are memory-mapped and only `source` (and `text`, for unit characters) is read.
    """
    sampling = cfg.language_sampling
    assert sampling is not None
    columns = [schema.SOURCE, schema.TEXT] if sampling.unit == "characters" else [schema.SOURCE]
    tables = [
        read_ipc_stream(safe_join(ingest_dir, shard["name"]), columns)
        for _, shard in shards_of(manifest, TRAIN_SPLIT)
    ]
    budget = cfg.sample_documents if sampling.unit == "documents" else sampling.sample_characters
    return sample_languages(pa.concat_tables(tables), sampling, budget)


def language_metrics(plan: LanguageSample) -> dict[str, float]:
    """Flat per-language metrics for MLflow: `language.<code>.{natural,target,realised}_share`."""
    metrics: dict[str, float] = {}
    for name, share in plan.languages.items():
        key = re.sub(r"[^A-Za-z0-9_-]", "_", name)
        metrics[f"language.{key}.natural_share"] = round(share.natural_share, 6)
        metrics[f"language.{key}.target_share"] = round(share.target_share, 6)
        metrics[f"language.{key}.realised_share"] = round(share.realised_share, 6)
    return metrics


def training_texts(
    ingest_dir: Path, manifest: dict[str, Any], picks: np.ndarray | None, counter: dict[str, int]
) -> Iterator[list[str]]:
    """Stream the train split's texts in batches, shard by shard (memory-mapped).

    Only the rows in `picks` (sorted row numbers over the split, repeats allowed; None: all)
    are taken; `counter` accumulates documents and characters as they are yielded.
    """
    shards = shards_of(manifest, TRAIN_SPLIT)
    base = 0
    for _, shard in shards:
        table = read_ipc_stream(safe_join(ingest_dir, shard["name"]), [schema.TEXT])
        if picks is not None:
            local = picks[(picks >= base) & (picks < base + shard["rows"])] - base
            table = table.take(pa.array(local))
        base += shard["rows"]
        for start in range(0, table.num_rows, _BATCH_ROWS):
            texts: list[str] = table.column(0).slice(start, _BATCH_ROWS).to_pylist()
            counter["documents"] += len(texts)
            counter["characters"] += sum(map(len, texts))
            yield texts


def _own_files(cfg: TokenizerConfig) -> dict[str, Any]:
    assert cfg.pretrained is not None
    files = {k: v for k, v in cfg.pretrained.model_dump().items() if v is not None}
    # By name and bytes, not by path: a moved project keeps its key (docs/pipeline.md).
    return {k: {"name": Path(v).name, "sha256": sha256_file(Path(v))} for k, v in files.items()}


def _train(
    cfg: TokenizerConfig, ingest_dir: Path, ingest: dict[str, Any], counter: dict[str, int]
) -> tuple[Tokenizer, LanguageSample | None]:
    """Train on the verified train split: its language mix, or its evenly spaced sample."""
    shards = [s for _, s in shards_of(ingest, TRAIN_SPLIT)]
    verify_shards(ingest_dir, shards, "ingest")
    plan = language_plan(ingest_dir, ingest, cfg) if cfg.language_sampling is not None else None
    picks = (
        plan.rows
        if plan is not None
        else sample_rows(sum(s["rows"] for s in shards), cfg.sample_documents)
    )

    def texts() -> Iterator[list[str]]:  # a trainer may read the corpus twice: count one pass
        counter.update(documents=0, characters=0)
        return training_texts(ingest_dir, ingest, picks, counter)

    return train_tokenizer(texts, cfg), plan


def plan_tokenizer(
    cfg: TokenizerConfig, ingest_dir: Path | str, workspace: Path | str
) -> StageOutput:
    """Plan the tokenizer output: fingerprint (the corpus's or your files', config, code), place.

    Raises:
        StageInputError: `ingest_dir` holds no finished ingest-format output.
    """
    ingest = read_upstream(ingest_dir, "ingest")
    inputs = (
        {"files": _own_files(cfg)}
        if cfg.pretrained is not None
        else {"ingest": ingest["fingerprint"], "split": TRAIN_SPLIT, "trainer": TRAINER_VERSION}
    )
    return plan_output(STAGE, inputs, public_dump(cfg), workspace=Path(workspace))


def run_tokenizer(
    cfg: TokenizerConfig, ingest_dir: Path, workspace: Path, rebuild: bool = False
) -> StageResult:
    """Train the tokenizer on an ingest output's train split (or load your own files).

    A complete output with the same fingerprint is reused as it is; with `rebuild` it is
    trained again and replaced whole.
    """
    started = time.monotonic()
    ingest = read_upstream(ingest_dir, "ingest")
    out = plan_tokenizer(cfg, ingest_dir, workspace)
    done = out.reuse(complete_manifest, rebuild)
    if done is not None:
        return StageResult(out.path, done, reused=True)
    counter = {"documents": 0, "characters": 0}
    clock = time.monotonic()
    plan: LanguageSample | None = None
    if cfg.pretrained is not None:
        tok = load_tokenizer_files(cfg.pretrained, cfg)
    else:
        tok, plan = _train(cfg, ingest_dir, ingest, counter)
    training_s = time.monotonic() - clock
    tmp = out.open_temp_dir()  # after training: a refused config or failed training leaves none
    to_transformers(tok, cfg).save_pretrained(tmp)
    files = [file_entry(tmp, p) for p in sorted(tmp.iterdir())]
    metrics = {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "padded_vocab_size": padded_vocab_size(tok, cfg),
        "training_s": round(training_s, 3),
        "documents": counter["documents"],
        "characters": counter["characters"],
        **(language_metrics(plan) if plan is not None else {}),
    }
    manifest = {
        **out.header(),
        "ingest": {"fingerprint": ingest["fingerprint"], "path": str(ingest_dir)},
        "special_tokens": {t: tok.token_to_id(t) for t in [*special_tokens(cfg), *sentinels(cfg)]},
        "tags": {"tokenizer_sha256": sha256_file(tmp / "tokenizer.json")},
        "files": files,
        "artifacts": [f["name"] for f in files],
        **({"language_sampling": plan.report()} if plan is not None else {}),
        "metrics": metrics | {"elapsed_s": round(time.monotonic() - started, 3)},
    }
    return out.commit(manifest, built_in=tmp)


def vocabulary_shortfall(cfg: TokenizerConfig, reached: int) -> str | None:
    """What to warn when a trained vocabulary is smaller than `tokenizer.vocab_size`, else None.

    A trainer stops when the text has no more pieces that occur `min_frequency` times: the
    model is then built for the size reached, not the size asked for. A char vocabulary is the
    text's alphabet, `vocab_size` only its cap (256 for a few dozen characters): never short.
    """
    if cfg.pretrained is not None or cfg.family == "char" or reached >= cfg.vocab_size:
        return None
    return (
        f"tokenizer.vocab_size {cfg.vocab_size:,} asked, {reached:,} reached: the training text "
        f"has no more pieces seen {cfg.min_frequency} times or more (more text, or a lower "
        "tokenizer.min_frequency, gives more)"
    )


@stage_task(STAGE, plan_tokenizer, complete_manifest)
def tokenizer_task(cfg: TokenizerConfig, ingest_dir: str, workspace: str) -> dict[str, Any]:
    """Train (or load) the tokenizer, or reuse a complete output; return its summary.

    Prefect's cache key is the output's fingerprint (`tasks.common.caching`); a refreshed
    cache retrains it.
    """
    rebuild = refresh_requested()
    result = run_tokenizer(cfg, Path(ingest_dir), Path(workspace), rebuild)
    metrics = result.manifest["metrics"]
    get_run_logger().info(
        "tokenizer %s: %s, %s tokens (%s padded), trained in %s s on %s documents",
        result.manifest["fingerprint"],
        "reused" if result.reused else "built",
        metrics["vocab_size"],
        metrics["padded_vocab_size"],
        metrics["training_s"],
        metrics["documents"],
    )
    shortfall = None if result.reused else vocabulary_shortfall(cfg, metrics["vocab_size"])
    if shortfall is not None:
        get_run_logger().warning(shortfall)
    for name, share in result.manifest.get("language_sampling", {}).get("languages", {}).items():
        get_run_logger().info(
            "language %s: natural share %.4f, target %.4f, realised %.4f "
            "(%s documents drawn from %s)",
            name,
            share["natural_share"],
            share["target_share"],
            share["realised_share"],
            share["sampled_documents"],
            share["documents"],
        )
    return result.summary()
