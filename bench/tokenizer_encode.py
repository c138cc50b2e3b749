"""Tokenizer training and corpus encoding: lmpipe's stages against the libraries called alone.

Usage: python bench/tokenizer_encode.py [--mb 110] [--vocab 30000] [--out bench/results]
       [--only encode|unigram]

Builds a JSON-Lines corpus of at least --mb MiB from the real texts in ../shared/data (random
windows of consecutive sentences of the Gutenberg books, Tiny Shakespeare and the IMDB
reviews), ingests it once, then measures, on the same documents:

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
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

import numpy as np  # noqa: E402 - after the environment and sys.path set-up above
import psutil  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from parity import ParityError, differing_segments, save_ids  # noqa: E402

from tasks.common import schema  # noqa: E402
from tasks.common.io import read_ipc_stream  # noqa: E402
from tasks.common.stage import shards_of  # noqa: E402
from tasks.encode.encode import sentence_segments  # noqa: E402
from tasks.ingest.text import SentenceConfig, split_sentences  # noqa: E402

CORES = os.cpu_count() or 1


def real_sentences() -> list[list[str]]:
    """Sentences of each real text in ../shared/data, one list per source document."""
    texts = []
    for book in sorted((SHARED / "gutenberg_books").glob("*.txt")):
        raw = book.read_text(encoding="utf-8-sig").replace("\r\n", "\n")
        texts.append(" ".join(raw.split()))
    texts.append(" ".join((SHARED / "tiny_shakespeare" / "input.txt").read_text().split()))
    with open(SHARED / "imdb_sample" / "texts.csv", newline="", encoding="utf-8") as handle:
        texts += [row["text"] for row in csv.DictReader(handle)]
    column = split_sentences(pa.array(texts, pa.large_string()), SentenceConfig())
    return [s for s in column.to_pylist() if s]


def pseudo_words(count: int, rng: random.Random) -> list[str]:
    """`count` distinct pronounceable pseudo-words of 1-4 syllables."""
    onsets = [
        "",
        "b",
        "br",
        "c",
        "ch",
        "d",
        "f",
        "g",
        "gr",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "pr",
        "qu",
        "r",
        "s",
        "sh",
        "st",
        "t",
        "th",
        "tr",
        "v",
        "w",
        "z",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck"]
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        words.add(
            "".join(
                rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(syllables)
            )
        )
    return sorted(words)


def write_corpus(path: Path, mib: int, seed: int = 0) -> Path:
    """Write documents of 4-40 real sentences until `mib` MiB, a fifth of their words swapped.

    The sentences come from the real texts, drawn at random (not as windows of consecutive
    ones, which repeat long passages and make suffix-array trainers like sentencepiece far
    slower than real text does). One word in five is replaced by a pseudo-word drawn from a
    Zipf law over a 2-million-word lexicon, so the vocabulary keeps growing with the corpus as
    real text does (Heaps' law) instead of stopping at the few megabytes of real text.
    """
    if path.exists() and path.stat().st_size >= mib << 20:
        return path
    rng = random.Random(seed)
    pool = [sentence.split(" ") for source in real_sentences() for sentence in source]
    lexicon = pseudo_words(2_000_000, rng)
    np_rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(path, "w", encoding="utf-8") as handle:
        while written < mib << 20:
            lines = []
            for _ in range(1000):
                words = [w for s in rng.choices(pool, k=rng.randint(4, 40)) for w in s]
                swap = np.flatnonzero(np_rng.random(len(words)) < 0.2)
                picks = (np_rng.zipf(1.2, len(swap)) - 1) % len(lexicon)
                for i, pick in zip(swap, picks, strict=True):
                    words[i] = lexicon[pick]
                lines.append(json.dumps({"text": " ".join(words)}))
            block = "\n".join(lines) + "\n"
            handle.write(block)
            written += len(block.encode())
    return path


def documents(ingest: Path, split: str | None) -> list[str]:
    """The ingested texts of one split (or all), in shard order, as a Python list."""
    manifest = json.loads((ingest / "manifest.json").read_text())
    texts: list[str] = []
    for _, shard in shards_of(manifest, split):
        texts += read_ipc_stream(ingest / shard["name"], [schema.TEXT]).column(0).to_pylist()
    return texts


def segments_of(ingest: Path) -> tuple[list[str], list[str], np.ndarray]:
    """Every document's id and sentence segments as the encode stage cuts them, in shard order.

    Returns the document ids, the segments of all documents in order, and each document's
    segment count; the segments of a document join back to its text exactly.
    """
    manifest = json.loads((ingest / "manifest.json").read_text())
    doc_ids: list[str] = []
    segments: list[str] = []
    counts = []
    for _, shard in shards_of(manifest):
        columns = [schema.DOC_ID, schema.TEXT, schema.SENTENCES]
        table = read_ipc_stream(ingest / shard["name"], columns)
        ids = table.column(schema.DOC_ID).to_pylist()
        texts = table.column(schema.TEXT).to_pylist()
        segs, count = sentence_segments(ids, texts, table.column(schema.SENTENCES).to_pylist())
        doc_ids += ids
        segments += segs
        counts.append(count)
    return doc_ids, segments, np.concatenate(counts)


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
    from tasks.tokenizer.tokenizer import TokenizerConfig

    return TokenizerConfig(
        family="unigram" if family.startswith("unigram") else family,  # type: ignore[arg-type]
        vocab_size=vocab,
        lowercase=family == "wordpiece",
        unigram_trainer=trainer,  # type: ignore[arg-type]
    )


# ---- phases: each runs in its own process and prints one JSON line ---------------------------


def phase_ingest(args: argparse.Namespace) -> dict[str, Any]:
    from tasks.common.ray_runtime import RayConfig
    from tasks.ingest.ingest import IngestConfig
    from tasks.ingest.sources import SourceConfig
    from tasks.ingest.stage import run_ingest

    cfg = IngestConfig(
        sources=[SourceConfig(path=str(args.corpus), format="jsonl")],
        dedup={"near": {"enabled": False}},  # type: ignore[arg-type]
        shard_size_mb=64,
        unit_size_mb=32,
    )
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


def run_phase(
    name: str, args: argparse.Namespace, script: str = __file__, **extra: Any
) -> dict[str, Any]:
    """Run one phase of `script` in a fresh process; return its JSON line and peak RSS."""
    argv = [sys.executable, script, "--phase", name, "--work", str(args.work)]
    argv += ["--vocab", str(args.vocab)]
    for key, value in extra.items():
        argv += [f"--{key}", str(value)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    peak = 0
    root = psutil.Process(process.pid)

    def sample() -> None:
        nonlocal peak
        while process.poll() is None:
            total = 0
            with contextlib.suppress(psutil.Error):
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        total += proc.memory_info().rss
            peak = max(peak, total)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"phase {name} {extra} failed with exit code {process.returncode}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result |= {"phase": name, **extra, "peak_rss_mib": round(peak / 2**20)}
    print(json.dumps(result, default=str), flush=True)
    return result


def best_of(
    args: argparse.Namespace, phases: list[tuple[str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Run a group of phases `args.repeat` times, interleaved; keep each one's fastest run.

    Interleaving puts the compared runs under the same background load; every run's time and
    the highest peak memory are kept beside the fastest run's figures.
    """
    runs: list[list[dict[str, Any]]] = [[] for _ in phases]
    for _ in range(args.repeat):
        for slot, (name, extra) in enumerate(phases):
            runs[slot].append(run_phase(name, args, **extra))
    best = []
    for group in runs:
        fastest = dict(min(group, key=lambda r: r["elapsed_s"]))
        fastest["all_elapsed_s"] = [round(r["elapsed_s"], 2) for r in group]
        fastest["peak_rss_mib"] = max(r["peak_rss_mib"] for r in group)
        best.append(fastest)
    return best


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


def write_results(args: argparse.Namespace, results: dict[str, Any]) -> None:
    out = args.out / "tokenizer_encode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))


def orchestrate(args: argparse.Namespace) -> None:
    corpus = write_corpus(args.work / f"corpus-{args.mb}.jsonl", args.mb)
    machine = {
        "cpus": CORES,
        "mem_gib": round(psutil.virtual_memory().total / 2**30),
        "python": platform.python_version(),
        "corpus_mib": round(corpus.stat().st_size / 2**20, 1),
        "load_average_at_start": os.getloadavg(),
    }
    results: dict[str, Any] = {"machine": machine, "vocab": args.vocab, "repeat": args.repeat}
    ingest = run_phase("ingest", args, corpus=corpus)
    results["ingest"] = ingest
    if args.only == "encode":
        where = {"ingest": ingest["path"], "family": "bpe"}
        bpe_dir = run_phase("train-stage", args, **where)["path"]
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
    training: list[dict[str, Any]] = []
    bpe_dir = ""
    for family in ("wordpiece", "bpe", "unigram"):
        where = {"ingest": ingest["path"], "family": family}
        stage, direct = best_of(args, [("train-stage", where), ("train-direct", where)])
        training.append({"family": family, "stage": stage, "direct": direct})
        if family == "bpe":
            bpe_dir = stage["path"]
    spm, tokenizers_unigram = best_of(
        args,
        [
            ("train-direct", {"ingest": ingest["path"], "family": "unigram-sentencepiece-only"}),
            ("train-direct", {"ingest": ingest["path"], "family": "unigram-tokenizers"}),
        ],
    )
    training.append({"family": "unigram-sentencepiece-only", "direct": spm})
    training.append({"family": "unigram-tokenizers", "direct": tokenizers_unigram})
    results["training"] = training
    results["encode"] = measure_encode(args, ingest["path"], bpe_dir)
    write_results(args, results)
    for row in training:
        if "stage" in row:
            ratio = row["stage"]["elapsed_s"] / row["direct"]["elapsed_s"]
            print(f"train {row['family']}: stage/direct {ratio:.3f}")
    ratio = tokenizers_unigram["elapsed_s"] / spm["elapsed_s"]
    print(f"unigram: tokenizers trainer / sentencepiece {ratio:.2f}")
    lmpipe = next(r for r in training if r["family"] == "unigram")["direct"]["elapsed_s"]
    print(
        f"unigram: tokenizers trainer / lmpipe (sentencepiece + conversion) "
        f"{tokenizers_unigram['elapsed_s'] / lmpipe:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=110)
    parser.add_argument("--vocab", type=int, default=30_000)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs; fastest kept")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("bench/results/tokenizer_work"))
    parser.add_argument("--phase", choices=sorted(PHASES))
    parser.add_argument(
        "--only", choices=["encode", "unigram"], help="measure only (a), or only Unigram's (b)"
    )
    parser.add_argument("--corpus", type=Path)
    parser.add_argument("--ingest", type=Path)
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--family")
    args = parser.parse_args()
    args.work = args.work.resolve()
    if args.phase:
        print(json.dumps(PHASES[args.phase](args), default=str), flush=True)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
