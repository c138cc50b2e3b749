"""Example creation: lmpipe's cores and stage against the de facto tools, on the same data.

Usage: python bench/examples_throughput.py [--mb 110] [--out bench/results]

Reuses the corpus of bench/tokenizer_encode.py (same generator), ingests it, trains a
WordPiece tokenizer and encodes it once (set-up, not measured), then measures:

- masking: `tasks.examples.objectives.mask_tokens` against
  `transformers.DataCollatorForLanguageModeling` on the same 64 batches of 256 unmasked BERT rows of
  128 tokens, with the realised mask rate and 80/10/10 shares of both;
- causal packing: the whole `causal` examples stage (read token shards, pack, write, on Ray)
  and its core alone in one process (read, pack, write) against `group_texts` run through
  `datasets.map(batched=True, num_proc=<cores>)` as the causal-LM example script does, on the
  same documents (end-of-text after each), with the block counts of both;
- every objective's whole examples stage (bert, sop, roberta, causal on the WordPiece
  encoding; span_corruption on a Unigram encoding with T5's sentinels): examples/s, MB of
  text/s and peak memory, at this corpus size and at half of it (peak memory flat when the
  corpus doubles).

Each measurement runs in a fresh subprocess whose process tree's peak RSS is sampled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa
from tokenizer_encode import CORES, run_phase, write_corpus

from tasks.common import schema
from tasks.common.io import read_ipc_stream

BATCHES, ROWS, LENGTH = 64, 256, 128


def _stage_setup(args: argparse.Namespace) -> dict[str, Any]:
    from tasks.common.ray_runtime import RayConfig
    from tasks.encode.encode import EncodeConfig
    from tasks.encode.stage import run_encode
    from tasks.ingest.ingest import IngestConfig
    from tasks.ingest.sources import SourceConfig
    from tasks.ingest.stage import run_ingest
    from tasks.tokenizer.stage import run_tokenizer
    from tasks.tokenizer.tokenizer import TokenizerConfig

    ray_cfg = RayConfig(num_workers=CORES)
    ws = args.work / f"ws-{args.corpus.stem}"
    ingest = run_ingest(
        IngestConfig(
            sources=[SourceConfig(path=str(args.corpus), format="jsonl")],
            dedup={"near": {"enabled": False}},  # type: ignore[arg-type]
            shard_size_mb=64,
            unit_size_mb=32,
        ),
        ray_cfg,
        ws,
    )
    family = args.family or "wordpiece"  # unigram: T5's sentinels, for span_corruption
    tok = run_tokenizer(
        TokenizerConfig(family=family, vocab_size=30_000, sample_documents=20_000),
        ingest.path,
        ws,
    )
    encode = run_encode(EncodeConfig(), ray_cfg, ingest.path, tok.path, ws)
    text_bytes = sum(
        read_ipc_stream(ingest.path / s["name"], [schema.TEXT]).column(0).nbytes
        for split in ("train", "validation")
        for s in ingest.manifest["splits"][split]["shards"]
    )
    return {
        "ingest": str(ingest.path),
        "tokenizer": str(tok.path),
        "encode": str(encode.path),
        "text_mb": text_bytes / 1e6,
        "elapsed_s": 0.0,
    }


def _examples_stage(args: argparse.Namespace, warm: bool = False) -> dict[str, Any]:
    """The whole examples stage on a fresh local Ray; `warm`: timed on its second run.

    Cold, the time includes starting the Ray workers and their imports. Warm, the same stage
    first runs once into another folder, so the timed run finds the workers up with the
    stage's modules imported, as in `lmpipe run`, where the stages share one Ray.
    """
    import ray

    from tasks.common.ray_runtime import RayConfig, ensure_ray
    from tasks.examples.config import ExamplesConfig
    from tasks.examples.stage import run_examples

    ray_cfg = RayConfig(num_workers=CORES)
    ensure_ray(ray_cfg)
    out = args.work / f"examples-{args.objective}-{Path(args.encode).name}"
    masking = "dynamic" if args.objective in ("causal", "span_corruption") else "static"
    cfg = ExamplesConfig(
        objective=args.objective, masking=masking, block_size=LENGTH, max_seq_length=LENGTH
    )
    if warm:
        shutil.rmtree(out.with_name(out.name + "-warmup"), ignore_errors=True)
        where = (Path(args.encode), Path(args.tokenizer), out.with_name(out.name + "-warmup"))
        run_examples(cfg, 0, ray_cfg, *where)
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    result = run_examples(cfg, 0, ray_cfg, Path(args.encode), Path(args.tokenizer), out)
    elapsed = time.perf_counter() - start
    ray.shutdown()
    split = result.manifest["splits"]["train"]
    examples = split["rows"] + result.manifest["splits"]["validation"]["rows"]
    return {
        "elapsed_s": elapsed,
        "examples": examples,
        "examples_per_s": examples / elapsed,
        "realised": split["realised"],
    }


def _bert_rows(args: argparse.Namespace) -> np.ndarray:
    """(BATCHES * ROWS, LENGTH) unmasked `[CLS] A [SEP] B [SEP]` rows from the corpus."""
    from tasks.common.ray_runtime import RayConfig
    from tasks.examples.config import ExamplesConfig
    from tasks.examples.stage import run_examples

    out = args.work / "rows"
    cfg = ExamplesConfig(objective="bert", masking="dynamic", max_seq_length=LENGTH)
    result = run_examples(
        cfg, 0, RayConfig(num_workers=CORES), Path(args.encode), Path(args.tokenizer), out
    )
    shards = result.manifest["splits"]["train"]["shards"]
    table = pa.concat_tables([read_ipc_stream(result.path / s["name"]) for s in shards])
    ids = np.stack(table.column(schema.INPUT_IDS).to_numpy(zero_copy_only=False))
    return ids[: BATCHES * ROWS].astype(np.int64)


def _masking(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    from tasks.examples.objectives.masking import MaskConfig, mask_tokens
    from tasks.examples.objectives.rng import sample_keys

    rows = _bert_rows(args)
    tok = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    specials = np.asarray(tok.all_special_ids)
    random_ids = np.setdiff1d(np.arange(len(tok)), specials)
    count = min(BATCHES, len(rows) // ROWS)
    batches = rows[: count * ROWS].reshape(count, ROWS, LENGTH)
    rows = rows[: count * ROWS]
    if args.side == "lmpipe":
        cfg = MaskConfig(max_predictions_per_seq=LENGTH)  # no cap, as the collator has none
        start = time.perf_counter()
        results = []
        for b, batch in enumerate(batches):
            maskable = ~np.isin(batch, specials)  # (ROWS, LENGTH)
            keys = sample_keys(0, 0, np.arange(b * ROWS, (b + 1) * ROWS))
            results.append(
                mask_tokens(batch, maskable, None, keys, cfg, tok.mask_token_id, random_ids)
            )
        elapsed = time.perf_counter() - start
        chosen = sum(r.chosen for r in results)
        shares = {
            k: sum(getattr(r, k) for r in results) / chosen
            for k in ("masked", "randomized", "kept")
        }
        rate = chosen / sum(r.maskable for r in results)
    else:
        torch.manual_seed(0)
        collator = DataCollatorForLanguageModeling(
            tok, mlm=True, mlm_probability=0.15, return_tensors="pt"
        )
        examples = [[{"input_ids": row} for row in batch.tolist()] for batch in batches]
        start = time.perf_counter()
        outs = [collator(batch) for batch in examples]
        elapsed = time.perf_counter() - start
        chosen = masked = randomized = maskable = 0
        for batch, out in zip(batches, outs, strict=True):
            labels = out["labels"].numpy()
            new = out["input_ids"].numpy()
            picked = labels != -100
            chosen += int(picked.sum())
            masked += int((picked & (new == tok.mask_token_id)).sum())
            randomized += int((picked & (new != tok.mask_token_id) & (new != batch)).sum())
            maskable += int((~np.isin(batch, specials)).sum())
        shares = {
            "masked": masked / chosen,
            "randomized": randomized / chosen,
            "kept": 1 - (masked + randomized) / chosen,
        }
        rate = chosen / maskable
    return {
        "elapsed_s": elapsed,
        "rows": len(rows),
        "rows_per_s": len(rows) / elapsed,
        "mask_rate": rate,
        "shares": shares,
    }


def _group_texts(args: argparse.Namespace) -> dict[str, Any]:
    import datasets

    manifest = json.loads((Path(args.encode) / "manifest.json").read_text())
    docs = []
    for split in ("train", "validation"):
        for shard in manifest["splits"][split]["shards"]:
            table = read_ipc_stream(Path(args.encode) / shard["name"], [schema.TOKEN_IDS])
            flat = pa.compute.list_flatten(table.column(0))  # sentences → one list per doc
            offsets = np.concatenate(
                [[0], np.cumsum(pa.compute.list_value_length(table.column(0)).to_numpy())]
            )
            lengths = pa.compute.list_value_length(flat).to_numpy()
            ends = np.concatenate([[0], np.cumsum(lengths)])
            ids = pa.compute.list_flatten(flat).to_numpy()
            for d in range(len(offsets) - 1):
                docs.append(ids[ends[offsets[d]] : ends[offsets[d + 1]]].astype(np.int32))
    eos = json.loads((Path(args.tokenizer) / "manifest.json").read_text())["special_tokens"][
        "[SEP]"
    ]
    corpus = datasets.Dataset.from_dict({"input_ids": [np.append(d, eos) for d in docs]})
    cache = args.work / "group-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)

    def group_texts(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        joined = [t for ids in batch["input_ids"] for t in ids]
        total = len(joined) // LENGTH * LENGTH
        return {"input_ids": [joined[i : i + LENGTH] for i in range(0, total, LENGTH)]}

    start = time.perf_counter()
    blocks = corpus.map(
        group_texts,
        batched=True,
        num_proc=CORES,
        cache_file_name=str(cache / "blocks.arrow"),
        load_from_cache_file=False,
    )
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "examples": len(blocks), "examples_per_s": len(blocks) / elapsed}


def _causal_in_process(args: argparse.Namespace) -> dict[str, Any]:
    """The causal core alone, in one process: read each token shard, pack, write Arrow."""
    from tasks.common.io import write_ipc_stream
    from tasks.examples.cutting import causal_blocks
    from tasks.examples.documents import encoded_docs
    from tasks.examples.examples import fixed

    manifest = json.loads((Path(args.encode) / "manifest.json").read_text())
    eos = json.loads((Path(args.tokenizer) / "manifest.json").read_text())["special_tokens"][
        "[SEP]"
    ]
    out = args.work / "causal-in-process"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    blocks_total = 0
    first = manifest["splits"]["train"]["shards"][0]["name"]  # warm-up: one-time imports
    encoded_docs(read_ipc_stream(Path(args.encode) / first, [schema.TOKEN_IDS]).slice(0, 8))
    start = time.perf_counter()
    for split in ("train", "validation"):
        for shard in manifest["splits"][split]["shards"]:
            table = read_ipc_stream(Path(args.encode) / shard["name"], [schema.TOKEN_IDS])
            blocks, starts, _ = causal_blocks(encoded_docs(table), LENGTH, eos)
            packed = pa.table(
                {
                    schema.INPUT_IDS: fixed(blocks, pa.uint16()),
                    schema.DOC_STARTS: starts,
                }
            )
            write_ipc_stream(packed, out / shard["name"])
            blocks_total += len(blocks)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "examples": blocks_total,
        "examples_per_s": blocks_total / elapsed,
    }


# Each tokenizer family's encoding and the objectives cut from it (T5 spans need sentinels).
FAMILY_OBJECTIVES = {
    "wordpiece": ("bert", "sop", "roberta", "causal"),
    "unigram": ("span_corruption",),
}

PHASES = {
    "causal-in-process": _causal_in_process,
    "setup": _stage_setup,
    "stage": _examples_stage,
    "stage-warm": lambda args: _examples_stage(args, warm=True),
    "masking": _masking,
    "group-texts": _group_texts,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=110)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("bench/results/tokenizer_work"))
    parser.add_argument("--phase", choices=sorted(PHASES))
    parser.add_argument("--corpus", type=Path)
    parser.add_argument("--encode")
    parser.add_argument("--tokenizer")
    parser.add_argument("--objective")
    parser.add_argument("--side")
    parser.add_argument("--family")
    parser.add_argument("--vocab", type=int, default=30_000)  # run_phase passes it
    args = parser.parse_args()
    args.work = args.work.resolve()
    if args.phase:
        print(json.dumps(PHASES[args.phase](args), default=str), flush=True)
        return
    results: dict[str, Any] = {"cpus": CORES, "stages": {}}
    for mb in (args.mb // 2, args.mb):
        corpus = write_corpus(args.work / f"corpus-{mb}.jsonl", mb)
        for family, objectives in FAMILY_OBJECTIVES.items():
            setup = run_phase("setup", args, __file__, corpus=corpus, family=family)
            where = {"encode": setup["encode"], "tokenizer": setup["tokenizer"]}
            for objective in objectives:
                stage = run_phase("stage", args, __file__, objective=objective, **where)
                stage["text_mb_per_s"] = setup["text_mb"] / stage["elapsed_s"]
                results["stages"][f"{objective}_{mb}mb"] = {"setup": setup, "stage": stage}
        where = {"encode": results["stages"][f"bert_{mb}mb"]["setup"]["encode"]}
        where["tokenizer"] = results["stages"][f"bert_{mb}mb"]["setup"]["tokenizer"]
    results["masking"] = {
        side: run_phase("masking", args, __file__, side=side, **where)
        for side in ("lmpipe", "collator")
    }
    results["causal"] = {
        "stage": results["stages"][f"causal_{args.mb}mb"]["stage"],
        "stage_warm": run_phase("stage-warm", args, __file__, objective="causal", **where),
        "in_process": run_phase("causal-in-process", args, __file__, **where),
        "group_texts": run_phase("group-texts", args, __file__, **where),
    }
    out = args.out / "examples_throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    masking, causal = results["masking"], results["causal"]
    print(
        "masking lmpipe/collator:",
        round(masking["lmpipe"]["rows_per_s"] / masking["collator"]["rows_per_s"], 1),
    )
    for ratio in ("stage", "stage_warm", "in_process"):
        speed = causal[ratio]["examples_per_s"] / causal["group_texts"]["examples_per_s"]
        print(f"causal {ratio}/group_texts:", round(speed, 1))
    for name, row in results["stages"].items():
        stage = row["stage"]
        print(
            f"{name}: {stage['examples_per_s']:,.0f} examples/s, "
            f"{stage['text_mb_per_s']:.2f} MB/s, peak {stage['peak_rss_mib']} MiB"
        )


if __name__ == "__main__":
    main()
