"""The examples stage: encoded shards → pretraining examples of one objective, on Ray.

Layout of one output, `<workspace>/examples/<fingerprint>/`: one example shard per encode shard
of the train and validation splits (same name; the test split is held out), and
`manifest.json`, written last, with the realised statistics. `_staging/` holds each finished
shard's counts while a run is in progress, so a rerun skips finished shards.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from prefect import get_run_logger
from tokenizers import Tokenizer

from tasks.common import schema
from tasks.common.caching import refresh_requested, stage_task
from tasks.common.io import (
    public_dump,
    read_ipc_stream,
    safe_join,
    sha256_file,
    write_ipc_stream,
    write_json_atomic,
)
from tasks.common.progress import make_reporter, ticker
from tasks.common.ray_runtime import RayConfig, run_units
from tasks.common.stage import (
    BuildOptions,
    StageOutput,
    StageResult,
    complete_sharded,
    content_hash,
    plan_output,
    read_upstream,
    shards_of,
    verify_shards,
)
from tasks.examples.config import ExamplesConfig
from tasks.examples.cutting import t5_raw_length
from tasks.examples.documents import EncodedDocs, encoded_docs
from tasks.examples.examples import ShardContext, cut_examples
from tasks.examples.objectives.masking import word_start_table
from tasks.examples.specials import Specials, objective_specials
from tasks.tokenizer.tokenizer import TokenizerConfig

STAGE = "examples"
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class ExamplesJob:
    """One encode shard to cut into one example shard."""

    src: str
    dst: str
    stats: str
    cfg: ExamplesConfig
    ctx: ShardContext
    split_shards: tuple[tuple[str, int], ...]  # (path, documents) of every shard of the split


# A worker keeps the shards it reads open: their ids stay memory-mapped (no copy), and only the
# offsets (8 bytes per sentence and per document) are in memory. NotNext draws hit every shard
# of the split, so a cache smaller than the split re-read a shard per draw; 64 shards of 4,096
# documents cover 262,144 documents before any is evicted.
@lru_cache(maxsize=64)
def _docs(path: str) -> EncodedDocs:
    return encoded_docs(read_ipc_stream(Path(path), [schema.TOKEN_IDS]))


def examples_shard(job: ExamplesJob) -> dict[str, Any]:
    """Cut one encode shard into examples, write them atomically, then their counts.

    A NotNext segment's document is drawn from the whole split by number and read from its
    shard by memory map: the corpus is never loaded.
    """
    stats_path, dst = Path(job.stats), Path(job.dst)
    if stats_path.exists() and dst.exists():
        return json.loads(stats_path.read_text())  # type: ignore[no-any-return]
    paths = [p for p, _ in job.split_shards]
    bounds = np.concatenate([[0], np.cumsum([n for _, n in job.split_shards])])
    total = int(bounds[-1])

    def random_doc(rng: np.random.Generator, current: int) -> tuple[int, list[np.ndarray]]:
        other = current
        for _ in range(10):  # as the original: a different document, ten tries
            other = int(rng.integers(0, total))
            if other != current:
                break
        shard = int(np.searchsorted(bounds, other, side="right") - 1)
        return other, _docs(paths[shard]).sentences(other - int(bounds[shard]))

    table, counts = cut_examples(_docs(job.src), job.cfg, job.ctx, random_doc)
    write_ipc_stream(table, dst)
    stats = {"rows": table.num_rows, "bytes": dst.stat().st_size, "sha256": sha256_file(dst)}
    write_json_atomic(stats_path, {**counts, **stats})
    return {**counts, **stats}


def plan_examples(
    cfg: ExamplesConfig,
    seed: int,
    encode_dir: Path | str,
    tokenizer_dir: Path | str,
    workspace: Path | str,
) -> StageOutput:
    """Plan the examples output: fingerprint (encoding, tokenizer, config, seed, code), place.

    Raises:
        StageInputError: an upstream output is not finished, or another stage's.
    """
    encode = read_upstream(encode_dir, "encode")
    read_upstream(tokenizer_dir, "tokenizer")  # a finished tokenizer output, or refused
    inputs = {"encode": encode["fingerprint"], "tokenizer": content_hash(tokenizer_dir)}
    return plan_output(STAGE, inputs, public_dump(cfg), workspace=Path(workspace), seed=seed)


def run_examples(
    cfg: ExamplesConfig,
    seed: int,
    ray_cfg: RayConfig,
    encode_dir: Path,
    tokenizer_dir: Path,
    workspace: Path,
    build: BuildOptions | None = None,
) -> StageResult:
    """Cut the encoded train and validation splits into examples of `cfg.objective`, on Ray.

    A complete output with the same fingerprint (encoding, tokenizer, config, seed, code) is
    reused as it is; with `build.rebuild` it is cut again aside and swapped in whole.
    `build.progress` hears of each shard cut; None is `BuildOptions()`.
    """
    build = build or BuildOptions()
    started = time.monotonic()
    encode = read_upstream(encode_dir, "encode")
    tokenizer = read_upstream(tokenizer_dir, "tokenizer")
    tok_cfg = TokenizerConfig.model_validate(tokenizer["config"])
    specials = objective_specials(
        cfg.objective, tok_cfg, tokenizer["special_tokens"], encode["vocab_size"]
    )
    out = plan_examples(cfg, seed, encode_dir, tokenizer_dir, workspace)
    done = out.reuse(complete_sharded, build.rebuild)
    if done is not None:
        return StageResult(out.path, done, reused=True)
    out = out.build_aside() if build.rebuild else out
    used = [s for split in SPLITS for _, s in shards_of(encode, split)]
    verify_shards(encode_dir, used, "encode")
    staging = out.open_staging()
    ids_type = pa.uint16() if encode["dtype"] == "uint16" else pa.uint32()
    words, random_ids = vocabulary_lookups(cfg, tokenizer_dir, tok_cfg, specials)
    first = ShardContext(seed, 0, 0, specials, ids_type, words, random_ids)
    jobs, where, sizes = example_jobs(cfg, first, encode, encode_dir, out.path, staging)
    tick = ticker(build.progress, "examples", len(jobs))
    read = sum(int(shard["bytes"]) for shard in used)
    results = run_units(examples_shard, jobs, ray_cfg, on_done=tick, sizes=sizes, input_bytes=read)
    splits = split_entries(cfg, where, results)
    manifest = {
        **out.header(),
        "objective": cfg.objective,
        "sequence_length": cfg.sequence_length,
        "seed": seed,
        "encode": {"fingerprint": encode["fingerprint"], "path": str(encode_dir)},
        "tokenizer": {
            "fingerprint": tokenizer["fingerprint"],
            "content": out.inputs["tokenizer"],
            "path": str(tokenizer_dir),
        },
        "specials": {k: v for k, v in vars(specials).items() if k != "special_ids"} if jobs else {},
        "schema": [str(f) for f in output_schema(cfg, ids_type)],
        "splits": splits,
        "metrics": {
            **{f"train_{k}": v for k, v in splits["train"]["realised"].items()},
            **{f"validation_{k}": v for k, v in splits["validation"]["realised"].items()},
            "elapsed_s": round(time.monotonic() - started, 3),
        },
    }
    return out.commit(manifest)


def example_jobs(
    cfg: ExamplesConfig,
    first: ShardContext,
    encode: dict[str, Any],
    encode_dir: Path,
    out_dir: Path,
    staging: Path,
) -> tuple[list[ExamplesJob], list[tuple[str, str]], list[int]]:
    """One job per encode shard of `SPLITS`, its (split, shard name), and its size in tokens.

    Each job's context is `first` with the shard's number in its split and the number of its
    first document.
    """
    jobs, where, sizes = [], [], []
    for split in SPLITS:
        entries = encode["splits"][split]["shards"]
        split_shards = tuple((str(safe_join(encode_dir, e["name"])), e["rows"]) for e in entries)
        base = 0
        for number, entry in enumerate(entries):
            jobs.append(
                ExamplesJob(
                    src=str(safe_join(encode_dir, entry["name"], what="encode shard")),
                    dst=str(safe_join(out_dir, entry["name"], what="example shard")),
                    stats=str(staging / f"{entry['name']}.json"),
                    cfg=cfg,
                    ctx=replace(first, shard=number, doc_base=base),
                    split_shards=split_shards,
                )
            )
            where.append((split, entry["name"]))
            sizes.append(entry["tokens"])
            base += entry["rows"]
    return jobs, where, sizes


def _static_mlm(cfg: ExamplesConfig) -> bool:
    """Whether the masks are written into the shards (static masking of an MLM objective)."""
    return cfg.masking == "static" and cfg.objective in ("bert", "sop", "roberta")


def vocabulary_lookups(
    cfg: ExamplesConfig, tokenizer_dir: Path, tok_cfg: TokenizerConfig, specials: Specials
) -> tuple[np.ndarray | None, np.ndarray]:
    """The word-start table (whole-word masking) and the ids a random replacement draws from.

    Only static masking and BART's infilling draw random tokens or need word starts; the
    other objectives skip the vocabulary scan and ship no lookups with their jobs.
    """
    words: np.ndarray | None = None
    random_ids = np.empty(0, np.int64)
    if _static_mlm(cfg) or cfg.objective == "denoising":
        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        size = tok.get_vocab_size(with_added_tokens=True)
        vocab = [tok.id_to_token(i) or "" for i in range(size)]
        if cfg.mask.whole_word:
            words = word_start_table(vocab, tok_cfg.family, set(specials.special_ids))
        random_ids = np.setdiff1d(np.arange(size), np.fromiter(specials.special_ids, np.int64))
    return words, random_ids


def split_entries(
    cfg: ExamplesConfig, where: list[tuple[str, str]], results: list[dict[str, Any]]
) -> dict[str, Any]:
    """The manifest's `splits`: each split's rows, shard entries, summed counts and statistics."""
    splits: dict[str, Any] = {s: {"rows": 0, "shards": [], "counts": {}} for s in SPLITS}
    for (split, name), stats in zip(where, results, strict=True):
        entry = {k: stats[k] for k in ("rows", "bytes", "sha256")}
        splits[split]["shards"].append({"name": name, **entry})
        splits[split]["rows"] += stats["rows"]
        counts = splits[split]["counts"]
        for key, value in stats.items():
            if key not in ("rows", "bytes", "sha256"):
                counts[key] = counts.get(key, 0) + value
    for entry in splits.values():
        entry["realised"] = realised(cfg, entry["counts"])
    return splits


def output_schema(cfg: ExamplesConfig, ids_type: pa.DataType) -> pa.Schema:
    """The schema of the example shards `cfg` makes, with token ids of `ids_type`."""
    targets = t5_raw_length(cfg)[1] if cfg.objective == "span_corruption" else 0
    return schema.examples_schema(
        cfg.objective,
        cfg.sequence_length,
        ids_type,
        labels=_static_mlm(cfg) or cfg.objective == "denoising",
        targets_length=targets,
    )


def realised(cfg: ExamplesConfig, counts: dict[str, int]) -> dict[str, float]:
    """The realised statistics of one split from its summed counts."""

    def ratio(a: str, b: str) -> float:
        return counts.get(a, 0) / counts[b] if counts.get(b) else 0.0

    stats = {
        "examples": float(counts.get("examples", 0)),
        "real_tokens": float(counts.get("real_tokens", 0)),
        "packing_efficiency": ratio("real_tokens", "slot_tokens"),
        "padding_fraction": 1.0 - ratio("real_tokens", "slot_tokens")
        if counts.get("slot_tokens")
        else 0.0,
    }
    if "chosen_tokens" in counts:
        stats |= {
            "mask_rate": ratio("chosen_tokens", "maskable_tokens"),
            "mask_token_share": ratio("mask_token", "chosen_tokens"),
            "random_token_share": ratio("random_token", "chosen_tokens"),
            "kept_token_share": ratio("kept_token", "chosen_tokens"),
        }
    if cfg.objective in ("bert", "sop"):
        stats["positive_label_rate"] = ratio("positive_labels", "examples")
    if "dropped_tokens" in counts:
        kept = (
            counts.get("real_tokens", 0)
            if cfg.objective == "causal"
            else counts.get("raw_tokens", 0)
        )
        stats["corpus_tokens_used"] = kept / max(kept + counts["dropped_tokens"], 1)
    if cfg.objective == "span_corruption":
        stats["noise_density"] = ratio("noise_tokens", "raw_tokens")
        stats["mean_noise_span_length"] = ratio("noise_tokens", "noise_spans")
    if cfg.objective == "denoising":
        stats |= {
            "mask_ratio": ratio("masked_tokens", "content_tokens"),
            "mean_span_length": ratio("masked_tokens", "noise_spans"),  # 0-length ones included
            "inserted_span_share": ratio("inserted_spans", "noise_spans"),
            "random_token_share": ratio("random_tokens", "noise_tokens"),
            "permuted_row_rate": ratio("permuted_rows", "examples"),
            "encoder_length_ratio": ratio("encoder_tokens", "real_tokens"),
        }
    return stats


@stage_task(STAGE, plan_examples, complete_sharded)
def examples_task(
    cfg: ExamplesConfig,
    seed: int,
    ray_cfg: RayConfig,
    encode_dir: str,
    tokenizer_dir: str,
    workspace: str,
) -> dict[str, Any]:
    """Cut the examples (or reuse a complete output); return the stage summary.

    Prefect's cache key is the output's fingerprint (`tasks.common.caching`); a refreshed
    cache cuts them again.
    """
    logger = get_run_logger()
    result = run_examples(
        cfg,
        seed,
        ray_cfg,
        Path(encode_dir),
        Path(tokenizer_dir),
        Path(workspace),
        BuildOptions(make_reporter(logger), rebuild=refresh_requested()),
    )
    logger.info(
        "examples %s (%s): %s, %s",
        result.manifest["fingerprint"],
        cfg.objective,
        "reused" if result.reused else "built",
        result.manifest["splits"]["train"]["realised"],
    )
    return result.summary()
