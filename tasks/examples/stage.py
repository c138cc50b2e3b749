"""The examples stage: encoded shards → pretraining examples of one objective, on Ray.

Layout of one output, `<workspace>/examples/<fingerprint>/`: one example shard per encode shard
of the train and validation splits (same name; the test split is held out), and
`manifest.json`, written last, with the realised statistics. `_staging/` holds each finished
shard's counts while a run is in progress, so a rerun skips finished shards.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from tokenizers import Tokenizer

from tasks.common import schema
from tasks.common.io import (
    code_version,
    fingerprint,
    public_dump,
    read_ipc_stream,
    safe_join,
    sha256_file,
    write_ipc_stream,
    write_json_atomic,
)
from tasks.common.progress import Reporter, make_reporter, ticker
from tasks.common.ray_runtime import RayConfig, ensure_ray, map_bounded
from tasks.common.schema import ObjectiveMismatchError
from tasks.common.stage import (
    StageResult,
    complete_sharded,
    manifest_header,
    open_staging,
    read_upstream,
    shards_of,
    sweep_leftovers,
    verify_shards,
)
from tasks.examples.examples import (
    EncodedDocs,
    ExamplesConfig,
    ShardContext,
    Specials,
    cut_examples,
    encoded_docs,
    t5_raw_length,
)
from tasks.examples.objectives import word_start_table
from tasks.tokenizer.tokenizer import TokenizerConfig, roles

STAGE = "examples"
SPLITS = ("train", "validation")
_NEEDS = {
    "bert": ("cls", "sep", "mask"),
    "sop": ("cls", "sep", "mask"),
    "roberta": ("cls", "sep", "mask"),
    "causal": ("eos",),
    "span_corruption": ("eos",),
    "denoising": ("cls", "eos", "mask", "pad"),  # <s>, </s> (also the decoder start), mask, pad
}
_USE = {
    "span_corruption": "tokenizer.family=unigram",
    "denoising": "tokenizer.family=bpe with tokenizer.bpe_style=roberta, or "
    "tokenizer.family=wordpiece",
}


def objective_specials(
    objective: str, tok_cfg: TokenizerConfig, ids: dict[str, int], vocab_size: int
) -> Specials:
    """Map the tokenizer's special tokens to the roles `objective` needs, or refuse the pair.

    Raises:
        ObjectiveMismatchError: a needed role has no token in this tokenizer family.
    """
    role = {name: ids.get(token) for name, token in roles(tok_cfg).items()}
    if tok_cfg.family == "wordpiece":
        role["eos"] = ids.get("[SEP]")  # a document separator for causal blocks
    missing = [name for name in _NEEDS[objective] if role.get(name) is None]
    sentinel_top = ids.get("<extra_id_0>")
    if objective == "span_corruption" and sentinel_top is None:
        missing.append("sentinels <extra_id_0>...")
    if missing:
        raise ObjectiveMismatchError(
            f"examples.objective={objective} needs {missing}, which a {tok_cfg.family} "
            f"tokenizer ({tok_cfg.bpe_style if tok_cfg.family == 'bpe' else 'default'} style) "
            "does not have; use " + _USE.get(objective, "wordpiece")
        )
    pad = role.get("pad")
    if pad is None:
        pad = role["eos"]  # GPT-2 has no padding token; blocks are full anyway
    assert pad is not None
    return Specials(
        cls=role.get("cls"),
        sep=role.get("sep"),
        pad=pad,
        mask=role.get("mask"),
        eos=role.get("eos"),
        sentinel_top=sentinel_top,
        vocab_size=vocab_size,
        special_ids=frozenset(ids.values()),
    )


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


def run_examples(
    cfg: ExamplesConfig,
    seed: int,
    ray_cfg: RayConfig,
    encode_dir: Path,
    tokenizer_dir: Path,
    workspace: Path,
    progress: Reporter | None = None,
) -> StageResult:
    """Cut the encoded train and validation splits into examples of `cfg.objective`, on Ray.

    A complete output with the same fingerprint (encoding, tokenizer, config, seed, code) is
    reused as it is.
    """
    started = time.monotonic()
    encode = read_upstream(encode_dir, "encode")
    tokenizer = read_upstream(tokenizer_dir, "tokenizer")
    tok_cfg = TokenizerConfig.model_validate(tokenizer["config"])
    specials = objective_specials(
        cfg.objective, tok_cfg, tokenizer["special_tokens"], encode["vocab_size"]
    )
    config = public_dump(cfg)
    code = code_version("tasks")
    inputs = {"encode": encode["fingerprint"], "tokenizer": tokenizer["fingerprint"]}
    fp = fingerprint(
        {"inputs": inputs, "config": config, "seed": seed, "code": code["source_hash"]}
    )
    out = workspace / STAGE / fp
    done = complete_sharded(out)
    if done is not None:
        sweep_leftovers(out)
        return StageResult(out, done, reused=True)
    used = [s for split in SPLITS for _, s in shards_of(encode, split)]
    verify_shards(encode_dir, used, "encode")
    staging = open_staging(out)
    ids_type = pa.uint16() if encode["dtype"] == "uint16" else pa.uint32()
    # Only static masking and BART's infilling draw random tokens or need word starts; the
    # other objectives skip the vocabulary scan and ship no lookups with their jobs.
    words: np.ndarray | None = None
    random_ids = np.empty(0, np.int64)
    static_mlm = cfg.masking == "static" and cfg.objective in ("bert", "sop", "roberta")
    if static_mlm or cfg.objective == "denoising":
        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        size = tok.get_vocab_size(with_added_tokens=True)
        vocab = [tok.id_to_token(i) or "" for i in range(size)]
        if cfg.mask.whole_word:
            words = word_start_table(vocab, tok_cfg.family, set(specials.special_ids))
        random_ids = np.setdiff1d(np.arange(size), np.fromiter(specials.special_ids, np.int64))
    jobs, where, sizes = [], [], []
    for split in SPLITS:
        entries = encode["splits"][split]["shards"]
        split_shards = tuple((str(safe_join(encode_dir, e["name"])), e["rows"]) for e in entries)
        base = 0
        for number, entry in enumerate(entries):
            ctx = ShardContext(seed, number, base, specials, ids_type, words, random_ids)
            jobs.append(
                ExamplesJob(
                    src=str(safe_join(encode_dir, entry["name"], what="encode shard")),
                    dst=str(safe_join(out, entry["name"], what="example shard")),
                    stats=str(staging / f"{entry['name']}.json"),
                    cfg=cfg,
                    ctx=ctx,
                    split_shards=split_shards,
                )
            )
            where.append((split, entry["name"]))
            sizes.append(entry["tokens"])
            base += entry["rows"]
    ensure_ray(ray_cfg)
    tick = ticker(progress, "examples", len(jobs))
    results = map_bounded(examples_shard, jobs, ray_cfg.num_workers, on_done=tick, sizes=sizes)
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
    first = jobs[0].ctx if jobs else None
    length = cfg.sequence_length
    targets = t5_raw_length(cfg)[1] if cfg.objective == "span_corruption" else 0
    out_schema = schema.examples_schema(
        cfg.objective,
        length,
        ids_type,
        labels=static_mlm or cfg.objective == "denoising",
        targets_length=targets,
    )
    manifest = {
        **manifest_header(STAGE, fp, config, code, inputs),
        "objective": cfg.objective,
        "sequence_length": length,
        "seed": seed,
        "encode": {"fingerprint": encode["fingerprint"], "path": str(encode_dir)},
        "tokenizer": {"fingerprint": tokenizer["fingerprint"], "path": str(tokenizer_dir)},
        "specials": {k: v for k, v in vars(first.specials).items() if k != "special_ids"}
        if first
        else {},
        "schema": [str(f) for f in out_schema],
        "splits": splits,
        "metrics": {
            **{f"train_{k}": v for k, v in splits["train"]["realised"].items()},
            **{f"validation_{k}": v for k, v in splits["validation"]["realised"].items()},
            "elapsed_s": round(time.monotonic() - started, 3),
        },
    }
    write_json_atomic(out / "manifest.json", manifest)
    sweep_leftovers(out)
    return StageResult(out, manifest, reused=False)


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


@task(name="examples", cache_policy=NO_CACHE)
def examples_task(
    cfg: ExamplesConfig,
    seed: int,
    ray_cfg: RayConfig,
    encode_dir: str,
    tokenizer_dir: str,
    workspace: str,
) -> dict[str, Any]:
    """Cut the examples (or reuse a complete output); return the stage summary."""
    logger = get_run_logger()
    result = run_examples(
        cfg,
        seed,
        ray_cfg,
        Path(encode_dir),
        Path(tokenizer_dir),
        Path(workspace),
        make_reporter(logger),
    )
    logger.info(
        "examples %s (%s): %s, %s",
        result.manifest["fingerprint"],
        cfg.objective,
        "reused" if result.reused else "built",
        result.manifest["splits"]["train"]["realised"],
    )
    return result.summary()
