"""The causal-packing arms of bench/examples_throughput.py and the check that they agree.

lmpipe's causal core (`causal_blocks` over each token shard, in one process) and
`group_texts` through `datasets.map`, as the causal-LM example script runs it, cut the same
documents into blocks of `LENGTH` tokens. Each arm saves its blocks (untimed) into the
workspace, and `causal_parity` checks them against the blocks of the documents' token stream.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from parity import ParityError, expected_blocks, require_equal_blocks, same_rows

from tasks.common import schema
from tasks.common.io import read_ipc_stream

LENGTH = 128  # tokens per block (and per BERT row of the masking comparison)
GROUP_BATCH = 1000  # documents per `group_texts` call: `datasets.map`'s default batch size
SPLITS = ("train", "validation")


def end_of_text(tokenizer: str | Path) -> int:
    """Return the id a tokenizer's `[SEP]` has: the end-of-text both arms put after a document."""
    manifest = json.loads((Path(tokenizer) / "manifest.json").read_text())
    eos: int = manifest["special_tokens"]["[SEP]"]
    return eos


def docs_stream(args: argparse.Namespace) -> tuple[list[np.ndarray], list[int], int]:
    """Every document's ids in shard order (train, then validation), shard starts, end id."""
    manifest = json.loads((Path(args.encode) / "manifest.json").read_text())
    docs: list[np.ndarray] = []
    shard_starts = []
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            shard_starts.append(len(docs))
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
    return docs, shard_starts, end_of_text(args.tokenizer)


def _group_texts(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """The causal-LM example script's `group_texts`: join a batch, cut full blocks."""
    joined = [t for ids in batch["input_ids"] for t in ids]
    total = len(joined) // LENGTH * LENGTH
    return {"input_ids": [joined[i : i + LENGTH] for i in range(0, total, LENGTH)]}


def group_texts(args: argparse.Namespace) -> dict[str, Any]:
    """`group_texts` through `datasets.map(batched=True)` on `--procs` processes.

    The documents (end-of-text after each) are saved as a dataset first and loaded
    memory-mapped, untimed, as a tokenized dataset in a user's cache is; the map reads them
    there, as lmpipe reads its token shards. With more than one process, `datasets` starts its
    pool inside `map`, so the time counts that start.
    """
    import datasets

    docs, _, eos = docs_stream(args)
    stored = args.work / "group-docs"
    shutil.rmtree(stored, ignore_errors=True)
    datasets.Dataset.from_dict({"input_ids": [np.append(d, eos) for d in docs]}).save_to_disk(
        str(stored)
    )
    corpus = datasets.load_from_disk(str(stored))
    cache = args.work / "group-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    procs = args.procs if args.procs > 1 else None
    start = time.perf_counter()
    blocks = corpus.map(
        _group_texts,
        batched=True,
        batch_size=GROUP_BATCH,
        num_proc=procs,
        cache_file_name=str(cache / "blocks.arrow"),
        load_from_cache_file=False,
    )
    elapsed = time.perf_counter() - start
    column = blocks.data.column("input_ids").combine_chunks()
    got = pa.compute.list_flatten(column).to_numpy().reshape(-1, LENGTH)
    np.save(args.work / f"blocks-group-texts-{args.procs}.npy", got)
    return {
        "elapsed_s": elapsed,
        "procs": args.procs,
        "examples": len(blocks),
        "examples_per_s": len(blocks) / elapsed,
    }


def causal_in_process(args: argparse.Namespace) -> dict[str, Any]:
    """The causal core alone, in one process: read each token shard, pack, write Arrow."""
    from tasks.common.io import write_ipc_stream
    from tasks.examples.cutting import causal_blocks
    from tasks.examples.documents import encoded_docs
    from tasks.examples.examples import fixed

    manifest = json.loads((Path(args.encode) / "manifest.json").read_text())
    eos = end_of_text(args.tokenizer)
    out = args.work / "causal-in-process"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    kept = []
    first = manifest["splits"]["train"]["shards"][0]["name"]  # warm-up: one-time imports
    encoded_docs(read_ipc_stream(Path(args.encode) / first, [schema.TOKEN_IDS]).slice(0, 8))
    start = time.perf_counter()
    for split in SPLITS:
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
            kept.append(blocks)
    elapsed = time.perf_counter() - start
    got = np.concatenate(kept)
    np.save(args.work / "blocks-causal-in-process.npy", got)
    return {
        "elapsed_s": elapsed,
        "examples": len(got),
        "examples_per_s": len(got) / elapsed,
    }


def stage_blocks(out: Path) -> np.ndarray:
    """Every block an examples stage wrote (train, then validation), as (B, LENGTH)."""
    manifest = json.loads((out / "manifest.json").read_text())
    parts = [
        read_ipc_stream(out / s["name"], [schema.INPUT_IDS]).column(0).combine_chunks()
        for split in SPLITS
        for s in manifest["splits"][split]["shards"]
    ]
    return np.concatenate(
        [pa.compute.list_flatten(p).to_numpy().reshape(-1, LENGTH) for p in parts]
    )


def causal_parity(args: argparse.Namespace, procs: list[int]) -> dict[str, Any]:
    """Check that lmpipe and `group_texts` cut the same token stream into the same blocks.

    Both join the documents, each followed by end-of-text, and cut full blocks; lmpipe starts
    afresh at each token shard, `group_texts` at each batch of `GROUP_BATCH` documents of each
    `datasets` process, and each drops its runs' tails. Each arm's blocks must equal that
    stream's blocks with its own restarts, exactly, and the stage's the core's, in any order.

    Raises:
        ParityError: an arm's blocks differ.
    """
    docs, shard_starts, eos = docs_stream(args)
    lengths = np.array([len(d) + 1 for d in docs], np.int64)
    stream = np.concatenate([np.append(d, eos) for d in docs])
    core = np.load(args.work / "blocks-causal-in-process.npy")
    want = expected_blocks(lengths, stream, np.array(shard_starts, np.int64), LENGTH)
    require_equal_blocks("lmpipe's causal core", core, want)
    report: dict[str, Any] = {"lmpipe_blocks": len(core)}
    for n in procs:
        div, mod = divmod(len(docs), n)  # datasets' contiguous shards, one per process
        firsts = [div * r + min(r, mod) for r in range(n)] + [len(docs)]
        restarts = np.concatenate(
            [np.arange(a, b, GROUP_BATCH) for a, b in itertools.pairwise(firsts)]
        )
        got = np.load(args.work / f"blocks-group-texts-{n}.npy")
        require_equal_blocks(
            f"group_texts on {n}", got, expected_blocks(lengths, stream, restarts, LENGTH)
        )
        report[f"group_texts_{n}_blocks"] = len(got)
    stage = np.load(args.work / "blocks-stage.npy")
    if not same_rows(stage, core):
        raise ParityError("the causal stage's blocks differ from its core's")
    report["stage_blocks"] = len(stage)
    return report
