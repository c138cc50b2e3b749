"""The encode stage driver: ingest shards → token shards, on Ray; statistics; manifest.

Layout of one output, `<workspace>/encode/<fingerprint>/`: token shards named after the ingest
shard they come from and their part (`train-g0-00000-p0000.arrow` holds that shard's first
`shard_documents` documents, ...), `tokens_per_document.png` and `manifest.json`, written
last. `_staging/` holds each finished shard's statistics while a run is in progress, so an
interrupted run resumes with the shards it had not finished.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prefect import get_run_logger
from tokenizers import Tokenizer

from tasks.common import schema
from tasks.common.caching import refresh_requested, stage_task
from tasks.common.io import atomic_writer, public_dump, safe_join
from tasks.common.progress import Reporter, make_reporter, ticker
from tasks.common.ray_runtime import RayConfig, run_units
from tasks.common.stage import (
    StageOutput,
    StageResult,
    complete_sharded,
    content_hash,
    plan_output,
    read_upstream,
    shards_of,
    verify_shards,
)
from tasks.encode.encode import (
    HISTOGRAM_EDGES,
    EncodeConfig,
    EncodeJob,
    encode_shard,
    id_type,
    merge_stats,
)
from tasks.tokenizer.tokenizer import unknown_id

if TYPE_CHECKING:
    import pyarrow as pa

STAGE = "encode"
HISTOGRAM_PNG = "tokens_per_document.png"


def plan_encode(
    cfg: EncodeConfig, ingest_dir: Path | str, tokenizer_dir: Path | str, workspace: Path | str
) -> StageOutput:
    """Plan the encode output: fingerprint (ingest, tokenizer, config, code) and place.

    Raises:
        StageInputError: an upstream output is not finished, or another stage's.
    """
    ingest = read_upstream(ingest_dir, "ingest")
    read_upstream(tokenizer_dir, "tokenizer")  # a finished tokenizer output, or refused
    # The tokenizer's bytes, not its fingerprint: token shards never pair with another vocabulary.
    inputs = {"ingest": ingest["fingerprint"], "tokenizer": content_hash(tokenizer_dir)}
    return plan_output(STAGE, inputs, public_dump(cfg), workspace=Path(workspace))


def run_encode(
    cfg: EncodeConfig,
    ray_cfg: RayConfig,
    ingest_dir: Path,
    tokenizer_dir: Path,
    workspace: Path,
    progress: Reporter | None = None,
    rebuild: bool = False,
) -> StageResult:
    """Encode every split of an ingest output with a tokenizer output (`run_units`: on Ray).

    A complete output of the same fingerprint is reused; with `rebuild`, encoded aside and swapped.
    """
    started = time.monotonic()
    ingest = read_upstream(ingest_dir, "ingest")
    tokenizer = read_upstream(tokenizer_dir, "tokenizer")
    out = plan_encode(cfg, ingest_dir, tokenizer_dir, workspace)
    done = out.reuse(complete_sharded, rebuild)
    if done is not None:
        return StageResult(out.path, done, reused=True)
    out = out.build_aside() if rebuild else out
    verify_shards(ingest_dir, [s for _, s in shards_of(ingest)], "ingest")
    staging = out.open_staging()
    tok_file = tokenizer_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_file))
    ids = id_type(tok.get_vocab_size(with_added_tokens=True), cfg)
    parts = encode_parts(ingest, cfg.shard_documents)
    jobs = encode_jobs(cfg, (ingest_dir, out.path, staging, tok_file), parts, ids, unknown_id(tok))
    tick = ticker(progress, "encode", len(jobs))
    sizes = [job.stop - job.start for job in jobs]
    read = sum(int(shard["bytes"]) for _, shard in shards_of(ingest))
    results = run_units(encode_shard, jobs, ray_cfg, on_done=tick, sizes=sizes, input_bytes=read)
    splits, total = split_entries(list(ingest["splits"]), parts, results)
    plot_histogram(total, out.path / HISTOGRAM_PNG)
    manifest = {
        **out.header(),
        "ingest": {"fingerprint": ingest["fingerprint"], "path": str(ingest_dir)},
        "tokenizer": {
            "fingerprint": tokenizer["fingerprint"],
            "content": out.inputs["tokenizer"],
            "path": str(tokenizer_dir),
        },
        "schema": [str(f) for f in schema.tokens_schema(ids)],
        "dtype": str(ids),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "splits": splits,
        "histogram": {"edges": HISTOGRAM_EDGES.tolist(), "documents": total["histogram"]},
        "artifacts": [HISTOGRAM_PNG],
        "metrics": summary_metrics(total) | {"elapsed_s": round(time.monotonic() - started, 3)},
    }
    return out.commit(manifest)


def encode_jobs(
    cfg: EncodeConfig,
    paths: tuple[Path, Path, Path, Path],
    parts: list[Part],
    ids: pa.DataType,
    unk_id: int | None,
) -> list[EncodeJob]:
    """One `EncodeJob` per part of the ingest shards.

    `paths` are the ingest output, the output, its staging directory and the tokenizer file;
    `ids` is the token id type and `unk_id` the unknown token's id.
    """
    ingest_dir, out_dir, staging, tok_file = paths
    return [
        EncodeJob(
            src=str(safe_join(ingest_dir, shard["name"], what="ingest shard")),
            start=start,
            stop=stop,
            dst=str(safe_join(out_dir, name, what="token shard")),
            stats=str(staging / f"{name}.json"),
            tokenizer=str(tok_file),
            ids=str(ids),
            unk_id=unk_id,
            cfg=cfg,
        )
        for _, shard, start, stop, name in parts
    ]


#: One token shard to write: (split, ingest shard entry, first row, stop row, shard name).
Part = tuple[str, dict[str, Any], int, int, str]


def encode_parts(ingest: dict[str, Any], shard_documents: int) -> list[Part]:
    """Cut every ingest shard into parts of `shard_documents` documents, one token shard each.

    A part is named after its ingest shard and its number: `train-g0-00000-p0000.arrow`. An
    empty ingest shard still gets one (empty) part.
    """
    return [
        (split, shard, start, min(start + shard_documents, shard["rows"]), _part_name(shard, k))
        for split, shard in shards_of(ingest)
        for k, start in enumerate(range(0, max(shard["rows"], 1), shard_documents))
    ]


def _part_name(shard: dict[str, Any], k: int) -> str:
    return f"{shard['name'].removesuffix('.arrow')}-p{k:04d}.arrow"


def split_entries(
    names: list[str], parts: list[Part], results: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest's `splits` (rows, tokens, shard entries) and the statistics summed over all."""
    splits: dict[str, Any] = {name: {"rows": 0, "tokens": 0, "shards": []} for name in names}
    total: dict[str, Any] = {}
    for (split, shard, start, stop, name), stats in zip(parts, results, strict=True):
        splits[split]["shards"].append(
            {
                "name": name,
                "rows": stats["documents"],
                "tokens": stats["tokens"],
                "bytes": stats["bytes"],
                "sha256": stats["sha256"],
                "source": {"shard": shard["name"], "start": start, "stop": stop},
            }
        )
        splits[split]["rows"] += stats["documents"]
        splits[split]["tokens"] += stats["tokens"]
        total = merge_stats(total, {k: v for k, v in stats.items() if k not in ("bytes", "sha256")})
    return splits, total


def summary_metrics(total: dict[str, Any]) -> dict[str, float]:
    """The stage's headline figures: counts, unknown-token rate, characters per token."""
    tokens = max(total["tokens"], 1)
    documents = max(total["documents"], 1)
    return {
        "documents": total["documents"],
        "sentences": total["sentences"],
        "tokens": total["tokens"],
        "characters": total["characters"],
        "unknown_tokens": total["unknown_tokens"],
        "unknown_rate": total["unknown_tokens"] / tokens,
        "documents_with_unknown": total["documents_with_unknown"],
        "characters_per_token": total["characters"] / tokens,
        "tokens_per_document_mean": total["tokens"] / documents,
        "tokens_per_document_max": total["max_tokens_per_document"],
    }


def plot_histogram(total: dict[str, Any], path: Path) -> None:
    """Draw the tokens-per-document histogram (log-spaced bins) as a PNG, atomically."""
    # Imported here: matplotlib costs every `lmpipe` command's start, and only this plot needs it.
    from matplotlib.figure import Figure

    counts = np.asarray(total["histogram"])
    used = np.flatnonzero(counts)
    figure = Figure(figsize=(8, 4.5), dpi=100)
    axes = figure.subplots()
    if len(used):
        lo, hi = used[0], used[-1] + 1
        # Bin i spans [edge i, edge i+1); the last bin is open, drawn one quarter octave wide.
        right = np.append(HISTOGRAM_EDGES[1:], HISTOGRAM_EDGES[-1] * 2**0.25)
        edges = np.append(HISTOGRAM_EDGES[lo:hi], right[hi - 1])
        axes.stairs(counts[lo:hi], np.maximum(edges, 0.5), fill=True)
        axes.set_xscale("log")
    axes.set_xlabel("tokens per document (log scale)")
    axes.set_ylabel("documents")
    axes.set_title(
        f"{total['documents']:,} documents, {total['tokens']:,} tokens, "
        f"mean {total['tokens'] / max(total['documents'], 1):,.1f} per document"
    )
    figure.tight_layout()
    with atomic_writer(path) as handle:
        figure.savefig(handle, format="png")


@stage_task(STAGE, plan_encode, complete_sharded)
def encode_task(
    cfg: EncodeConfig, ray_cfg: RayConfig, ingest_dir: str, tokenizer_dir: str, workspace: str
) -> dict[str, Any]:
    """Encode the corpus into token shards (or reuse a complete output); return its summary.

    Prefect's cache key is the output's fingerprint (`tasks.common.caching`); a refreshed
    cache encodes it again.
    """
    logger = get_run_logger()
    result = run_encode(
        cfg,
        ray_cfg,
        Path(ingest_dir),
        Path(tokenizer_dir),
        Path(workspace),
        make_reporter(logger),
        rebuild=refresh_requested(),
    )
    metrics = result.manifest["metrics"]
    logger.info(
        "encode %s: %s, %s documents, %s tokens, %.2f characters per token, unknown rate %.2e",
        result.manifest["fingerprint"],
        "reused" if result.reused else "built",
        metrics["documents"],
        metrics["tokens"],
        metrics["characters_per_token"],
        metrics["unknown_rate"],
    )
    return result.summary()
