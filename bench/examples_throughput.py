"""Example creation: lmpipe's cores and stage against the de facto tools, on the same data.

Usage: python bench/examples_throughput.py [--mb 110] [--out bench/results]
       [--only stages,masking,causal] [--repeat 3]

Reuses the corpus of bench/tokenizer_encode.py (the same generator, bench/corpus.py), ingests
it, trains a WordPiece tokenizer and encodes it once (set-up, not measured), then measures:

- masking: `tasks.examples.objectives.mask_tokens` against
  `transformers.DataCollatorForLanguageModeling` on the same 64 batches of 256 unmasked BERT rows of
  128 tokens, each arm given the special-token mask and one thread: the collator's masking
  (`torch_mask_tokens`) on int64 tensors with `special_tokens_mask`, and the collator called
  on features holding `input_ids` and `special_tokens_mask`, as a `DataLoader` calls it.
  Every batch's output is checked (labels only at maskable positions and equal to the
  original id, unchosen positions unchanged), and each arm must mask 15% at 80/10/10 (±1%);
- causal packing, like for like: the whole `causal` examples stage with all of its start-up
  counted (the local Ray and its 2 workers) against `group_texts` run through
  `datasets.map(batched=True, num_proc=<cores>)` as the causal-LM example script does,
  with its pool's start counted; and the stage's core in one process (read, pack, write)
  against the same `datasets.map` in one process (no pool), neither starting anything. Both
  read the same documents from disk (end-of-text after each); each arm's blocks must be
  exactly the blocks of that token stream with its own restart points (lmpipe: each shard;
  `group_texts`: each batch of each process), and the stage's the core's;
- every objective's whole examples stage (bert, sop, roberta, causal on the WordPiece
  encoding; span_corruption on a Unigram encoding with T5's sentinels): examples/s, MB of
  text/s and peak memory, at this corpus size and at half of it (peak memory flat when the
  corpus doubles).

Each measurement runs in a fresh subprocess whose process tree's peak RSS is sampled; the
compared arms run interleaved, `--repeat` rounds, and the median of each is kept. A failed
parity check exits non-zero (`parity.py`).
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
from causal_packing import LENGTH, causal_in_process, causal_parity, group_texts, stage_blocks
from corpus import jsonl_ingest_config, write_corpus
from harness import (
    CORES,
    add_folder_args,
    median_run,
    phase_entry,
    phase_rounds,
    run_phase,
    write_json,
)
from parity import masking_counts, masking_summary, require_same_masking

from tasks.common import schema
from tasks.common.io import read_ipc_stream

BATCHES, ROWS = 64, 256  # the masking comparison: batches of rows of LENGTH tokens


def _stage_setup(args: argparse.Namespace) -> dict[str, Any]:
    from tasks.common.ray_runtime import RayConfig
    from tasks.encode.encode import EncodeConfig
    from tasks.encode.stage import run_encode
    from tasks.ingest.stage import run_ingest
    from tasks.tokenizer.stage import run_tokenizer
    from tasks.tokenizer.tokenizer import TokenizerConfig

    ray_cfg = RayConfig(num_workers=CORES)
    ws = args.work / f"ws-{args.corpus.stem}"
    ingest = run_ingest(jsonl_ingest_config(args.corpus), ray_cfg, ws)
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


def _examples_stage(
    args: argparse.Namespace, warm: bool = False, with_ray_start: bool = False
) -> dict[str, Any]:
    """The whole examples stage on a fresh local Ray; `warm`: timed on its second run.

    Cold, the time includes starting the Ray workers and their imports; `with_ray_start`, also
    starting the local Ray itself (all of lmpipe's start-up, as `datasets.map` counts its
    pool's). Warm, the same stage first runs once into another folder, so the timed run finds
    the workers up with the stage's modules imported, as in `lmpipe run`, where the stages
    share one Ray.
    """
    import ray

    from tasks.common.ray_runtime import RayConfig, ensure_ray
    from tasks.examples.config import ExamplesConfig
    from tasks.examples.stage import run_examples

    ray_cfg = RayConfig(num_workers=CORES)
    ray_start = time.perf_counter()
    ensure_ray(ray_cfg)
    ray_start_s = time.perf_counter() - ray_start
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
    elapsed = time.perf_counter() - start + (ray_start_s if with_ray_start else 0.0)
    ray.shutdown()
    if args.objective == "causal":
        np.save(args.work / "blocks-stage.npy", stage_blocks(result.path))
    split = result.manifest["splits"]["train"]
    examples = split["rows"] + result.manifest["splits"]["validation"]["rows"]
    return {
        "elapsed_s": elapsed,
        "examples": examples,
        "examples_per_s": examples / elapsed,
        "ray_start_s": ray_start_s,
        "realised": split["realised"],
    }


def _bert_rows(args: argparse.Namespace) -> np.ndarray:
    """(BATCHES * ROWS, LENGTH) unmasked `[CLS] A [SEP] B [SEP]` rows from the corpus."""
    from tasks.common.ray_runtime import RayConfig
    from tasks.examples.config import ExamplesConfig
    from tasks.examples.stage import run_examples

    cached = args.work / f"bert-rows-{Path(args.encode).name}.npy"  # every arm, every round
    if cached.exists():
        return np.load(cached)
    out = args.work / "rows"
    cfg = ExamplesConfig(objective="bert", masking="dynamic", max_seq_length=LENGTH)
    result = run_examples(
        cfg, 0, RayConfig(num_workers=CORES), Path(args.encode), Path(args.tokenizer), out
    )
    shards = result.manifest["splits"]["train"]["shards"]
    table = pa.concat_tables([read_ipc_stream(result.path / s["name"]) for s in shards])
    ids = np.stack(table.column(schema.INPUT_IDS).to_numpy(zero_copy_only=False))
    rows = ids[: BATCHES * ROWS].astype(np.int64)
    np.save(cached, rows)
    return rows


def _masking_batches(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, Any]:
    """The batches (count, ROWS, LENGTH), their special-token mask, and the tokenizer."""
    import ray
    from transformers import PreTrainedTokenizerFast

    rows = _bert_rows(args)
    ray.shutdown()  # the rows' stage is done, if it ran: no Ray beside the timed masking
    tok = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    count = min(BATCHES, len(rows) // ROWS)
    batches = rows[: count * ROWS].reshape(count, ROWS, LENGTH)
    # What a `datasets` pipeline gives the collator with `return_special_tokens_mask=True`;
    # lmpipe's example stage knows its maskable positions the same way, before masking.
    special = np.isin(batches, np.asarray(tok.all_special_ids))
    return batches, special, tok


def _mask_lmpipe(batches: np.ndarray, special: np.ndarray, tok: Any) -> tuple[list[Any], float]:
    """Mask each batch with `mask_tokens`; return the (ids, labels) of each and the time."""
    from tasks.examples.objectives.masking import MaskConfig, mask_tokens
    from tasks.examples.objectives.rng import sample_keys

    cfg = MaskConfig(max_predictions_per_seq=LENGTH)  # no cap, as the collator has none
    random_ids = np.setdiff1d(np.arange(len(tok)), tok.all_special_ids)
    maskable = ~special
    outs = []
    start = time.perf_counter()
    for b, batch in enumerate(batches):
        keys = sample_keys(0, 0, np.arange(b * ROWS, (b + 1) * ROWS))
        r = mask_tokens(batch, maskable[b], None, keys, cfg, tok.mask_token_id, random_ids)
        outs.append((r.input_ids, r.labels))
    return outs, time.perf_counter() - start


def _mask_collator(
    side: str, batches: np.ndarray, special: np.ndarray, tok: Any
) -> tuple[list[Any], float]:
    """Mask each batch with the collator (`side`); return the (ids, labels) of each and the time.

    `collator-masking` calls `torch_mask_tokens` on fresh tensors (it masks them in place);
    `collator-call` calls the collator on each batch's features, as a `DataLoader` does.
    """
    import torch
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(
        tok, mlm=True, mlm_probability=0.15, return_tensors="pt"
    )
    if side == "collator-masking":
        inputs = [
            (torch.from_numpy(b.copy()), torch.from_numpy(m))
            for b, m in zip(batches, special, strict=True)
        ]
        start = time.perf_counter()
        outs = [collator.torch_mask_tokens(x, special_tokens_mask=m) for x, m in inputs]
        return outs, time.perf_counter() - start
    features = [
        [
            {"input_ids": row, "special_tokens_mask": mask}
            for row, mask in zip(b.tolist(), m.astype(np.int64).tolist(), strict=True)
        ]
        for b, m in zip(batches, special, strict=True)
    ]
    start = time.perf_counter()
    called = [collator(f) for f in features]
    elapsed = time.perf_counter() - start
    return [(c["input_ids"], c["labels"]) for c in called], elapsed


def _masking(args: argparse.Namespace) -> dict[str, Any]:
    """One masking arm on the same batches; every batch's output is checked (`parity.py`).

    `lmpipe`: `mask_tokens` on each (ROWS, LENGTH) NumPy batch and its maskable mask.
    `collator-masking`: the collator's masking, `torch_mask_tokens`, on each batch as an int64
    tensor with its `special_tokens_mask` tensor: the same work as `mask_tokens`.
    `collator-call`: the collator called as a `DataLoader` calls it, on each batch as a list of
    ROWS features holding `input_ids` and `special_tokens_mask` (pads, stacks, then masks).
    """
    import torch

    batches, special, tok = _masking_batches(args)
    if args.side == "lmpipe":
        outs, elapsed = _mask_lmpipe(batches, special, tok)
    else:
        # One thread, as `mask_tokens` runs, and as torch runs in a `DataLoader` worker.
        torch.set_num_threads(1)
        torch.manual_seed(0)
        outs, elapsed = _mask_collator(args.side, batches, special, tok)
    counts = [
        masking_counts(batch, spec, np.asarray(new), np.asarray(labels), tok.mask_token_id)
        for batch, spec, (new, labels) in zip(batches, special, outs, strict=True)
    ]
    rows = batches.shape[0] * ROWS
    return {"elapsed_s": elapsed, "rows": rows, "rows_per_s": rows / elapsed} | masking_summary(
        counts
    )


# Each tokenizer family's encoding and the objectives cut from it (T5 spans need sentinels).
FAMILY_OBJECTIVES = {
    "wordpiece": ("bert", "sop", "roberta", "causal"),
    "unigram": ("span_corruption",),
}

PHASES = {
    "causal-in-process": causal_in_process,
    "setup": _stage_setup,
    "stage": _examples_stage,
    "stage-warm": lambda args: _examples_stage(args, warm=True),
    "stage-with-ray-start": lambda args: _examples_stage(args, with_ray_start=True),
    "masking": _masking,
    "group-texts": group_texts,
}


def _rounds(
    args: argparse.Namespace, arms: dict[str, tuple[str, dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """Run each arm's phase `args.repeat` times, interleaved; keep the median run of each.

    Interleaving puts the compared arms under the same background load; every run's time is
    kept beside the median one's figures.
    """
    runs = phase_rounds(args, __file__, arms.values())
    return {name: median_run(group) for name, group in zip(arms, runs, strict=True)}


def _compare_masking(args: argparse.Namespace, where: dict[str, str]) -> dict[str, Any]:
    """`mask_tokens` against the collator's masking and the collator's call; parity checked."""
    sides = ("lmpipe", "collator-masking", "collator-call")
    arms = _rounds(args, {side: ("masking", {"side": side, **where}) for side in sides})
    require_same_masking(arms)
    for side in sides[1:]:
        ratio = arms["lmpipe"]["rows_per_s"] / arms[side]["rows_per_s"]
        arms[f"lmpipe/{side}"] = {"ratio": ratio}
        print(f"masking lmpipe/{side}: {ratio:.1f}x (medians of {args.repeat})")
    return arms


def _compare_causal(args: argparse.Namespace, where: dict[str, str]) -> dict[str, Any]:
    """Causal packing, like for like: start-up counted on both arms, or on neither."""
    arms = _rounds(
        args,
        {
            # Both count their start-up: the local Ray and its workers; the pool of processes.
            "stage": ("stage-with-ray-start", {"objective": "causal", **where}),
            f"group_texts_{CORES}": ("group-texts", {"procs": CORES, **where}),
            # Neither starts anything: one process each.
            "in_process": ("causal-in-process", where),
            "group_texts_1": ("group-texts", {"procs": 1, **where}),
        },
    )
    arms["parity"] = causal_parity(argparse.Namespace(**(vars(args) | where)), [1, CORES])
    print("causal parity:", json.dumps(arms["parity"]))
    pairs = {"stage": f"group_texts_{CORES}", "in_process": "group_texts_1"}
    for lm, base in pairs.items():
        ratio = arms[lm]["examples_per_s"] / arms[base]["examples_per_s"]
        arms[f"{lm}/{base}"] = {"ratio": ratio}
        print(f"causal {lm}/{base}: {ratio:.1f}x (medians of {args.repeat})")
    return arms


def _all_stages(args: argparse.Namespace) -> dict[str, Any]:
    """Every objective's whole stage, at half the corpus and at the whole of it."""
    stages: dict[str, Any] = {}
    for mb in (args.mb // 2, args.mb):
        corpus = write_corpus(args.work / f"corpus-{mb}.jsonl", mb)
        for family, objectives in FAMILY_OBJECTIVES.items():
            setup = run_phase("setup", args, __file__, corpus=corpus, family=family)
            where = {"encode": setup["encode"], "tokenizer": setup["tokenizer"]}
            for objective in objectives:
                stage = run_phase("stage", args, __file__, objective=objective, **where)
                stage["text_mb_per_s"] = setup["text_mb"] / stage["elapsed_s"]
                stages[f"{objective}_{mb}mb"] = {"setup": setup, "stage": stage}
    for name, row in stages.items():
        stage = row["stage"]
        print(
            f"{name}: {stage['examples_per_s']:,.0f} examples/s, "
            f"{stage['text_mb_per_s']:.2f} MB/s, peak {stage['peak_rss_mib']} MiB"
        )
    return stages


def main() -> None:
    """Command line: the whole benchmark, or one `--phase` of it (in its own process)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=110)
    add_folder_args(parser)
    parser.add_argument("--only", default="stages,masking,causal", help="comma-separated parts")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; median kept")
    parser.add_argument("--phase", choices=sorted(PHASES))
    parser.add_argument("--corpus", type=Path)
    parser.add_argument("--encode")
    parser.add_argument("--tokenizer")
    parser.add_argument("--objective")
    parser.add_argument("--side")
    parser.add_argument("--family")
    parser.add_argument("--procs", type=int, default=CORES)
    parser.add_argument("--vocab", type=int, default=30_000)  # run_phase passes it
    args = parser.parse_args()
    if phase_entry(args, PHASES):
        return
    only = set(args.only.split(","))
    results: dict[str, Any] = {"cpus": CORES, "load_average_at_start": os.getloadavg()}
    if "stages" in only:
        results["stages"] = _all_stages(args)
    corpus = write_corpus(args.work / f"corpus-{args.mb}.jsonl", args.mb)
    setup = run_phase("setup", args, __file__, corpus=corpus, family="wordpiece")  # reused
    where = {"encode": setup["encode"], "tokenizer": setup["tokenizer"]}
    try:
        if "masking" in only:
            results["masking"] = _compare_masking(args, where)
        if "causal" in only:
            results["causal"] = _compare_causal(args, where)
    finally:
        results["load_average_at_end"] = os.getloadavg()
        write_json(args.out / "examples_throughput.json", results, indent=2, default=str)


if __name__ == "__main__":
    main()
