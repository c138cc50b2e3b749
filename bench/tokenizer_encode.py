"""Tokenizer training and corpus encoding: lmpipe's stages against the libraries called alone.

Usage: python bench/tokenizer_encode.py [--mb 110] [--vocab 30000] [--out bench/results]
       [--only encode|unigram]

Builds a JSON-Lines corpus of at least --mb MiB from the real texts in ../shared/data (random
windows of consecutive sentences of the Gutenberg books, Tiny Shakespeare and the IMDB
reviews; bench/corpus.py), ingests it once, then measures, on the same documents:

(a) encoding, tokens/s: the whole `encode` stage (read shards, encode, write token shards, on
    a local Ray with one worker per core) against `Tokenizer.encode_batch_fast` alone on the
    same sentence segments already in memory (all cores), and against
    `datasets.Dataset.map(tokenizer, batched=True, num_proc=<cores>)` over the same segments
    in a memory-mapped dataset; also the stage with `encode.fast_ascii=false` (`tokenizers`
    encodes every sentence), the stage as it was before the byte-level fast path. Every arm
    encodes the same segments (each sentence with the whitespace before it, as the stage cuts
    them) without special tokens and saves its ids (untimed); the run fails unless every arm's
    ids equal the stage's (`parity.py`). The floor also counts, untimed, the documents whose
    whole-document encoding differs from their segments' ids joined;
(b) training time: the `tokenizer` stage (streaming the train split from the shards) against
    the trainer called on the documents already in a Python list, per family; for Unigram,
    also sentencepiece against the `tokenizers` Unigram trainer;
(c) the peak memory of each: every measurement runs in a fresh subprocess, and the summed RSS
    of it and all its children (Ray, datasets workers) is sampled every 0.1 s.

`--only encode` trains the byte-level BPE tokenizer once (untimed) and measures only (a);
`--only unigram` measures only the Unigram rows of (b): the stage against the direct call.
lmpipe's Unigram is sentencepiece's trainer plus a conversion, so its time against
sentencepiece alone is the conversion's overhead, not a speed-up; the independent comparison is
against the `tokenizers` Unigram trainer.

Each phase runs as `--phase NAME` in a subprocess of its own (bench/harness.py, `run_phase`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # the shared modules, when loaded from elsewhere

import numpy as np  # noqa: E402 - after the environment and sys.path set-up above
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from corpus import documents, jsonl_ingest_config, segments_of, write_corpus  # noqa: E402
from harness import (  # noqa: E402
    CORES,
    add_folder_args,
    fastest,
    memory_gib,
    phase_entry,
    phase_rounds,
    run_phase,
    write_json,
)
from parity import ParityError, differing_segments, save_ids  # noqa: E402

from tasks.common import schema  # noqa: E402
from tasks.common.io import read_ipc_stream  # noqa: E402
from tasks.common.stage import shards_of  # noqa: E402


def ids_file(args: argparse.Namespace, arm: str) -> Path:
    """Where an encode arm saves its ids for the parity check."""
    return args.work / "ids" / f"{arm}.npz"


def save_stage_ids(args: argparse.Namespace, encode_dir: Path, arm: str) -> None:
    """Save the ids the encode stage wrote, per sentence, in the ingest's document order."""
    manifest = json.loads((encode_dir / "manifest.json").read_text())
    tables = [
        read_ipc_stream(encode_dir / s["name"], [schema.DOC_ID, schema.TOKEN_IDS])
        for _, s in shards_of(manifest)
    ]
    table = pa.concat_tables(tables)
    doc_ids, _, _ = segments_of(args.ingest)
    if table.column(schema.DOC_ID).to_pylist() != doc_ids:
        raise ParityError("the encode stage wrote its documents in another order")
    sentences = pc.list_flatten(table.column(schema.TOKEN_IDS))
    lengths = pc.list_value_length(sentences).to_numpy(zero_copy_only=False)
    save_ids(ids_file(args, arm), pc.list_flatten(sentences).to_numpy(), lengths)


def tokenizer_config(family: str, vocab: int, trainer: str = "sentencepiece") -> Any:
    """Build the tokenizer config of a family (`unigram-*`: Unigram with another trainer)."""
    from tasks.tokenizer.tokenizer import TokenizerConfig

    return TokenizerConfig(
        family="unigram" if family.startswith("unigram") else family,  # type: ignore[arg-type]
        vocab_size=vocab,
        lowercase=family == "wordpiece",
        unigram_trainer=trainer,  # type: ignore[arg-type]
    )


# ---- phases: each runs in its own process and prints one JSON line ---------------------------


def phase_ingest(args: argparse.Namespace) -> dict[str, Any]:
    """Ingest the corpus once: the documents every later phase reads."""
    from tasks.common.ray_runtime import RayConfig
    from tasks.ingest.stage import run_ingest

    cfg = jsonl_ingest_config(args.corpus)
    start = time.perf_counter()
    result = run_ingest(cfg, RayConfig(num_workers=CORES), args.work / "ws")
    counts = result.manifest["counts"]
    return {
        "path": str(result.path),
        "elapsed_s": time.perf_counter() - start,
        "documents": counts["kept"],
        "train_documents": result.manifest["splits"]["train"]["rows"],
    }


def phase_train_stage(args: argparse.Namespace) -> dict[str, Any]:
    """Time the `tokenizer` stage (a build, never a cache hit) on the ingested train split."""
    from tasks.tokenizer.stage import run_tokenizer

    cfg = tokenizer_config(args.family, args.vocab)
    workspace = args.work / f"ws-{args.family}"
    shutil.rmtree(workspace, ignore_errors=True)  # measure a build, never a cache hit
    start = time.perf_counter()
    result = run_tokenizer(cfg, args.ingest, workspace)
    metrics = result.manifest["metrics"]
    return {
        "elapsed_s": time.perf_counter() - start,
        "training_s": metrics["training_s"],
        "documents": metrics["documents"],
        "vocab_size": metrics["vocab_size"],
        "path": str(result.path),
    }


def phase_train_direct(args: argparse.Namespace) -> dict[str, Any]:
    """Time the trainer called directly on the train split's documents in a Python list."""
    from tasks.tokenizer.tokenizer import train_sentencepiece, train_tokenizer

    start = time.perf_counter()
    texts = documents(args.ingest, "train")
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    if args.family == "unigram-sentencepiece-only":  # sentencepiece alone, no conversion
        train_sentencepiece(texts, tokenizer_config("unigram", args.vocab))
        vocab = None
    else:
        trainer = "tokenizers" if args.family == "unigram-tokenizers" else "sentencepiece"
        tok = train_tokenizer(texts, tokenizer_config(args.family, args.vocab, trainer))
        vocab = tok.get_vocab_size()
    return {
        "elapsed_s": time.perf_counter() - start,
        "load_s": load_s,
        "documents": len(texts),
        "vocab_size": vocab,
    }


def phase_encode_stage(
    args: argparse.Namespace, fast_ascii: bool = True, arm: str = "encode-stage"
) -> dict[str, Any]:
    """Time the whole `encode` stage on a local Ray (its start timed apart); save its ids."""
    import ray

    from tasks.common.ray_runtime import RayConfig, ensure_ray
    from tasks.encode.encode import EncodeConfig
    from tasks.encode.stage import run_encode

    ray_cfg = RayConfig(num_workers=CORES)
    shutil.rmtree(args.work / "ws-enc", ignore_errors=True)
    start = time.perf_counter()
    ensure_ray(ray_cfg)
    ray_start_s = time.perf_counter() - start
    start = time.perf_counter()
    cfg = EncodeConfig(fast_ascii=fast_ascii)
    result = run_encode(cfg, ray_cfg, args.ingest, args.tokenizer, args.work / "ws-enc")
    elapsed = time.perf_counter() - start
    ray.shutdown()
    save_stage_ids(args, result.path, arm)
    metrics = result.manifest["metrics"]
    return {
        "elapsed_s": elapsed,
        "ray_start_s": ray_start_s,
        "tokens": metrics["tokens"],
        "documents": metrics["documents"],
        "tokens_per_s": metrics["tokens"] / elapsed,
    }


def phase_encode_stage_tokenizers(args: argparse.Namespace) -> dict[str, Any]:
    """The encode stage with `tokenizers` encoding every sentence (no byte-level fast path)."""
    return phase_encode_stage(args, fast_ascii=False, arm="encode-stage-tokenizers")


def _warm_worker(_: int) -> str:
    """Import what an encode task imports, so that the timed stage finds warm workers."""
    import tasks.encode.encode  # noqa: F401

    return "warm"


def phase_encode_stage_warm(args: argparse.Namespace) -> dict[str, Any]:
    """The encode stage on a Ray whose workers already run (as after an earlier stage)."""
    from tasks.common.ray_runtime import RayConfig, ensure_ray, map_bounded

    ensure_ray(RayConfig(num_workers=CORES))
    map_bounded(_warm_worker, list(range(4 * CORES)), CORES)
    return phase_encode_stage(args, arm="encode-stage-warm")


def phase_encode_floor(args: argparse.Namespace) -> dict[str, Any]:
    """`tokenizers` alone on the stage's segments in memory, all cores; ids into NumPy."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    _, segments, counts = segments_of(args.ingest)
    flats, lengths = [], []
    start = time.perf_counter()
    for at in range(0, len(segments), 200_000):  # batches, so that Encodings do not pile up
        encodings = tok.encode_batch_fast(segments[at : at + 200_000], add_special_tokens=False)
        size = np.fromiter(map(len, encodings), np.int64, len(encodings))
        flats.append(
            np.fromiter(
                itertools.chain.from_iterable(e.ids for e in encodings), np.uint32, int(size.sum())
            )
        )
        lengths.append(size)
    elapsed = time.perf_counter() - start
    flat, length = np.concatenate(flats), np.concatenate(lengths)
    save_ids(ids_file(args, "encode-floor"), flat, length)
    return {
        "elapsed_s": elapsed,
        "tokens": len(flat),
        "segments": len(segments),
        "documents": len(counts),
        "tokens_per_s": len(flat) / elapsed,
        "whole_documents_differing": whole_document_differences(args, tok, segments, counts),
    }


def whole_document_differences(
    args: argparse.Namespace, tok: Any, segments: list[str], counts: np.ndarray
) -> dict[str, int]:
    """Untimed: the documents whose whole-text ids differ from their segments' ids joined."""
    at = np.concatenate([[0], np.cumsum(counts)])
    texts = ["".join(segments[a:b]) for a, b in itertools.pairwise(at)]
    encodings = [
        e
        for i in range(0, len(texts), 10_000)
        for e in tok.encode_batch_fast(texts[i : i + 10_000], add_special_tokens=False)
    ]
    size = np.fromiter(map(len, encodings), np.int64, len(encodings))
    flat = np.fromiter(
        itertools.chain.from_iterable(e.ids for e in encodings), np.uint32, int(size.sum())
    )
    save_ids(ids_file(args, "encode-floor-documents"), flat, size)
    joined = np.load(ids_file(args, "encode-floor"))
    per_doc = np.add.reduceat(joined["lengths"], at[:-1]) if len(joined["lengths"]) else size
    per_doc[counts == 0] = 0  # reduceat repeats a value at an empty range
    save_ids(ids_file(args, "encode-floor-joined"), joined["flat"], per_doc)
    return differing_segments(
        ids_file(args, "encode-floor-joined"), ids_file(args, "encode-floor-documents")
    )


def phase_encode_datasets(args: argparse.Namespace) -> dict[str, Any]:
    """`datasets.map` with the `transformers` tokenizer over the same segments, memory-mapped."""
    import datasets
    from transformers import AutoTokenizer

    _, segments, _ = segments_of(args.ingest)
    stored = args.work / "datasets-segments"
    shutil.rmtree(stored, ignore_errors=True)
    datasets.Dataset.from_dict({"segment": segments}).save_to_disk(str(stored))
    corpus = datasets.load_from_disk(str(stored))  # memory-mapped, as a user's cached dataset
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    cache = args.work / "datasets-cache"
    cache.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    encoded = corpus.map(
        lambda batch: tok(batch["segment"], add_special_tokens=False),
        batched=True,
        num_proc=CORES,
        remove_columns=["segment"],
        cache_file_name=str(cache / "map.arrow"),
        load_from_cache_file=False,
    )
    elapsed = time.perf_counter() - start
    column = encoded.data.column("input_ids").combine_chunks()
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    save_ids(ids_file(args, "encode-datasets"), pc.list_flatten(column).to_numpy(), lengths)
    tokens = int(lengths.sum())
    return {
        "elapsed_s": elapsed,
        "tokens": tokens,
        "segments": len(encoded),
        "tokens_per_s": tokens / elapsed,
    }


PHASES = {
    "ingest": phase_ingest,
    "train-stage": phase_train_stage,
    "train-direct": phase_train_direct,
    "encode-stage": phase_encode_stage,
    "encode-stage-warm": phase_encode_stage_warm,
    "encode-stage-tokenizers": phase_encode_stage_tokenizers,
    "encode-floor": phase_encode_floor,
    "encode-datasets": phase_encode_datasets,
}


# ---- the orchestrator ---------------------------------------------------------------------


def best_of(
    args: argparse.Namespace, phases: list[tuple[str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Run a group of phases `args.repeat` times, interleaved; keep each one's fastest run.

    Interleaving puts the compared runs under the same background load; every run's time and
    the highest peak memory are kept beside the fastest run's figures.
    """
    return [fastest(runs) for runs in phase_rounds(args, __file__, phases)]


ENCODE_PHASES = ["encode-stage", "encode-stage-tokenizers", "encode-floor", "encode-datasets"]


def measure_encode(args: argparse.Namespace, ingest: str, tokenizer: str) -> dict[str, Any]:
    """(a): the encode stage, with and without the fast path, the floor and `datasets.map`.

    Raises:
        ParityError: an arm's ids differ from the stage's.
    """
    where = {"ingest": ingest, "tokenizer": tokenizer}
    runs = best_of(args, [(n, where) for n in ENCODE_PHASES])
    enc = dict(zip(ENCODE_PHASES, runs, strict=True))
    reference = ids_file(args, "encode-stage")
    enc["parity"] = {
        arm: differing_segments(reference, ids_file(args, arm)) for arm in ENCODE_PHASES[1:]
    }
    print("parity (segments whose ids differ from the stage's):", json.dumps(enc["parity"]))
    floor, ds = enc["encode-floor"]["tokens_per_s"], enc["encode-datasets"]["tokens_per_s"]
    for name in ("encode-stage", "encode-stage-tokenizers"):
        stage = enc[name]["tokens_per_s"]
        print(f"{name}: /floor {stage / floor:.2f}x, /datasets.map {stage / ds:.2f}x")
    if any(p["differing"] for p in enc["parity"].values()):
        write_results(args, {"encode": enc})
        raise ParityError("encode arms produced different ids; see parity above")
    return enc


def measure_training(args: argparse.Namespace, ingest: str) -> tuple[list[dict[str, Any]], str]:
    """(b): each family's stage against its direct call, then the two Unigram trainers alone.

    Returns the rows and the byte-level BPE tokenizer the stage trained (for (a)).
    """
    training: list[dict[str, Any]] = []
    bpe_dir = ""
    for family in ("wordpiece", "bpe", "unigram"):
        where = {"ingest": ingest, "family": family}
        stage, direct = best_of(args, [("train-stage", where), ("train-direct", where)])
        training.append({"family": family, "stage": stage, "direct": direct})
        if family == "bpe":
            bpe_dir = stage["path"]
    spm, tokenizers_unigram = best_of(
        args,
        [
            ("train-direct", {"ingest": ingest, "family": "unigram-sentencepiece-only"}),
            ("train-direct", {"ingest": ingest, "family": "unigram-tokenizers"}),
        ],
    )
    training.append({"family": "unigram-sentencepiece-only", "direct": spm})
    training.append({"family": "unigram-tokenizers", "direct": tokenizers_unigram})
    return training, bpe_dir


def print_training(training: list[dict[str, Any]]) -> None:
    """Print each family's stage/direct ratio and how the Unigram trainers compare."""
    for row in training:
        if "stage" in row:
            ratio = row["stage"]["elapsed_s"] / row["direct"]["elapsed_s"]
            print(f"train {row['family']}: stage/direct {ratio:.3f}")
    direct = {row["family"]: row["direct"]["elapsed_s"] for row in training}
    tokenizers_unigram = direct["unigram-tokenizers"]
    ratio = tokenizers_unigram / direct["unigram-sentencepiece-only"]
    print(f"unigram: tokenizers trainer / sentencepiece {ratio:.2f}")
    print(
        f"unigram: tokenizers trainer / lmpipe (sentencepiece + conversion) "
        f"{tokenizers_unigram / direct['unigram']:.2f}"
    )


def write_results(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Write the results to OUT/tokenizer_encode.json."""
    write_json(args.out / "tokenizer_encode.json", results, indent=2, default=str)


def describe_machine(corpus: Path) -> dict[str, Any]:
    """Return the cores, memory and Python of the machine, the corpus's size, the load."""
    return {
        "cpus": CORES,
        "mem_gib": memory_gib(),
        "python": platform.python_version(),
        "corpus_mib": round(corpus.stat().st_size / 2**20, 1),
        "load_average_at_start": os.getloadavg(),
    }


def orchestrate(args: argparse.Namespace) -> None:
    """Build and ingest the corpus, then measure what `--only` names (all by default)."""
    corpus = write_corpus(args.work / f"corpus-{args.mb}.jsonl", args.mb)
    machine = describe_machine(corpus)
    results: dict[str, Any] = {"machine": machine, "vocab": args.vocab, "repeat": args.repeat}
    ingest = run_phase("ingest", args, __file__, corpus=corpus)
    results["ingest"] = ingest
    if args.only == "encode":
        where = {"ingest": ingest["path"], "family": "bpe"}
        bpe_dir = run_phase("train-stage", args, __file__, **where)["path"]
        results["encode"] = measure_encode(args, ingest["path"], bpe_dir)
        write_results(args, results)
        return
    if args.only == "unigram":
        where = {"ingest": ingest["path"], "family": "unigram"}
        stage, direct = best_of(args, [("train-stage", where), ("train-direct", where)])
        results["training"] = [{"family": "unigram", "stage": stage, "direct": direct}]
        write_results(args, results)
        print(f"train unigram: stage/direct {stage['elapsed_s'] / direct['elapsed_s']:.3f}")
        return
    training, bpe_dir = measure_training(args, ingest["path"])
    results["training"] = training
    results["encode"] = measure_encode(args, ingest["path"], bpe_dir)
    write_results(args, results)
    print_training(training)


def main() -> None:
    """Command line: the whole benchmark, or one `--phase` of it (in its own process)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=110)
    parser.add_argument("--vocab", type=int, default=30_000)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs; fastest kept")
    add_folder_args(parser)
    parser.add_argument("--phase", choices=sorted(PHASES))
    parser.add_argument(
        "--only", choices=["encode", "unigram"], help="measure only (a), or only Unigram's (b)"
    )
    parser.add_argument("--corpus", type=Path)
    parser.add_argument("--ingest", type=Path)
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--family")
    args = parser.parse_args()
    if not phase_entry(args, PHASES):
        orchestrate(args)


if __name__ == "__main__":
    main()
