"""The example sets the pretraining benchmarks train on, cut by lmpipe's own stages.

From the real texts of ../shared/data (the four Gutenberg books and Tiny Shakespeare, one
document per file, and the 1,000 IMDB reviews), through the ingest, tokenizer, encode and
examples stages on a local Ray (the caller's, or one started and stopped here): BERT examples
of 128 tokens (WordPiece, 30,522 tokens) for bench/pretrain_throughput.py and
bench/pretrain_gpu.py, and GPT-2 blocks of 1,024 tokens (byte-level BPE) for the latter. With
`tiny` (`prepare --tiny`, the CPU check) both come from one book's paragraphs, with
vocabularies of 1,024 and 64 tokens per example. Every stage reuses a complete output with the
same fingerprint, so a rerun is quick. `prepare` copies both sets, and with `wheels` the wheels
a GPU machine lacks (`WHEELS`), into the folder bench/pretrain_gpu.py carries there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import SHARED, write_json
from pretrain_arms import SEED

WORKERS = 2  # the local Ray's workers (the CPU benchmark's two cores)
SEQ_LEN = 128  # BERT examples' length
VOCAB = 30_522  # BERT's WordPiece vocabulary
GPT2_BLOCK = 1024
GPT2_VOCAB = 50_257  # GPT-2's published vocabulary
#: `tiny`: every vocabulary and length, and the one book (its paragraphs are the documents).
TINY = {"vocab": 1024, "length": 64, "book": "news_from_nowhere_3261.txt"}
#: Packages to carry as wheels (the GPU image has none of pydantic and DeepSpeed, and an older
#: transformers); their dependencies are in the image (docs/benchmarks.md, "GPU").
WHEELS = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "hjson",
    "transformers",
)


def ingest_shared_texts(ws: Path, ray_cfg: Any, tiny: bool = False) -> Any:
    """Ingest the real texts of ../shared/data (a book is one document) into workspace `ws`.

    `tiny`: `TINY`'s book alone, a paragraph per document.
    """
    from tasks.ingest.ingest import IngestConfig
    from tasks.ingest.stage import run_ingest

    books = {"format": "txt", "txt_mode": "file"}  # a book is one document: full 128-token rows
    sources = [
        {"path": str(SHARED / "gutenberg_books"), **books},
        {"path": str(SHARED / "tiny_shakespeare" / "input.txt"), **books},
        {"path": str(SHARED / "imdb_sample" / "texts.csv"), "format": "csv"},
    ]
    if tiny:
        book = SHARED / "gutenberg_books" / str(TINY["book"])
        sources = [{"path": str(book), "format": "txt", "txt_mode": "block"}]
    # Tiny Shakespeare is 1.1 M characters.
    cfg = IngestConfig.model_validate({"sources": sources, "max_chars": 2_000_000})
    return run_ingest(cfg, ray_cfg, ws)


def run_stages(
    work: Path, tokenizer_cfg: Any, examples_cfg: Any, tiny: bool = False
) -> tuple[Any, Any, Any]:
    """Run ingest, tokenizer, encode and examples in `work`/ws; return three stages' results.

    Returns the ingest's, the tokenizer's and the examples' results. A local Ray started here
    is shut down after them; a caller's keeps running.
    """
    import ray

    from tasks.common.ray_runtime import RayConfig
    from tasks.encode.encode import EncodeConfig
    from tasks.encode.stage import run_encode
    from tasks.examples.stage import run_examples
    from tasks.tokenizer.stage import run_tokenizer

    started = not ray.is_initialized()
    ray_cfg, ws = RayConfig(num_workers=WORKERS), work / "ws"
    ingest = ingest_shared_texts(ws, ray_cfg, tiny)
    tokenizer = run_tokenizer(tokenizer_cfg, ingest.path, ws)
    encode = run_encode(EncodeConfig(), ray_cfg, ingest.path, tokenizer.path, ws)
    examples = run_examples(examples_cfg, SEED, ray_cfg, encode.path, tokenizer.path, ws)
    if started:
        ray.shutdown()
    return ingest, tokenizer, examples


def prepare_examples(work: Path, tiny: bool = False) -> dict[str, Any]:
    """Ingest the real texts, train the WordPiece tokenizer, encode, cut BERT examples."""
    from tasks.examples.config import ExamplesConfig
    from tasks.tokenizer.tokenizer import TokenizerConfig

    vocab, length = (TINY["vocab"], TINY["length"]) if tiny else (VOCAB, SEQ_LEN)
    # min_frequency 1: the corpus (4.4 M characters) reaches 28,573 tokens at the default 2.
    tok_cfg = TokenizerConfig(family="wordpiece", vocab_size=vocab, min_frequency=1)
    cfg = ExamplesConfig(objective="bert", max_seq_length=length)
    ingest, tokenizer, examples = run_stages(work, tok_cfg, cfg, tiny)
    train = examples.manifest["splits"]["train"]
    return {
        "examples_dir": str(examples.path),
        "tokenizer_dir": str(tokenizer.path),
        "vocab_size": tokenizer.manifest["metrics"]["vocab_size"],
        "documents": {s: e["rows"] for s, e in ingest.manifest["splits"].items()},
        "train_examples": train["rows"],
        "train_real_tokens": train["counts"].get("real_tokens"),
        "train_padding_fraction": train["realised"].get("padding_fraction"),
    }


def prepare_gpt2_blocks(work: Path, tiny: bool = False) -> dict[str, Any]:
    """Byte-level BPE on the shared texts, then causal blocks of 1,024 tokens."""
    from tasks.examples.config import ExamplesConfig
    from tasks.tokenizer.tokenizer import TokenizerConfig

    vocab, length = (TINY["vocab"], TINY["length"]) if tiny else (GPT2_VOCAB, GPT2_BLOCK)
    tok_cfg = TokenizerConfig(family="bpe", bpe_style="gpt2", vocab_size=vocab)
    cfg = ExamplesConfig(objective="causal", block_size=length)
    _, tokenizer, examples = run_stages(work, tok_cfg, cfg, tiny)
    return {
        "examples_dir": str(examples.path),
        "tokenizer_dir": str(tokenizer.path),
        "vocab_size": tokenizer.manifest["metrics"]["vocab_size"],
        "train_examples": examples.manifest["splits"]["train"]["rows"],
    }


#: The objective of each example set `prepare` writes.
OBJECTIVES = {"bert": "bert", "gpt2": "causal"}


def check_prepared(data: Path, sets: set[str], given: str) -> None:
    """Exit unless `prepare --out GIVEN` wrote each of `sets` into `data`, for its objective."""
    for name in sorted(sets):
        manifest = data / name / "examples" / "manifest.json"
        if not manifest.is_file():
            raise SystemExit(f"{manifest}: missing; run `prepare --out {given}` first")
        objective = json.loads(manifest.read_text())["objective"]
        if objective != OBJECTIVES[name]:
            raise SystemExit(f"{manifest}: objective {objective!r}, not {OBJECTIVES[name]!r}")


def download_wheels(dest: Path) -> list[str]:
    """This venv's versions of `WHEELS` for CPython 3.12 on x86-64, and a DeepSpeed wheel."""
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
        "--platform=manylinux2014_x86_64"
    ]
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    download = ["download", "--no-deps", "--only-binary=:all:", "--python-version=3.12"]
    subprocess.run(
        [*pip, *download, "--implementation=cp", *platforms, "-d", str(dest), *pins], check=True
    )
    # DeepSpeed publishes a source archive only. Built here without its optional C++/CUDA ops
    # (lmpipe uses torch's fused AdamW), the wheel is pure Python.
    deepspeed = f"deepspeed=={version('deepspeed')}"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), deepspeed],
        check=True,
        env=os.environ | {"DS_BUILD_OPS": "0"},
    )
    return sorted(path.name for path in dest.glob("*.whl"))


def prepare(out: Path, work: Path, wheels: bool, tiny: bool = False) -> dict[str, Any]:
    """Build both example sets into `work`; copy what a GPU run reads (and wheels) to `out`."""
    built = {"bert": prepare_examples(work, tiny), "gpt2": prepare_gpt2_blocks(work, tiny)}
    for name, info in built.items():
        for part in ("examples", "tokenizer"):
            target = out / name / part
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(info[f"{part}_dir"], target)
    summary: dict[str, Any] = {"sets": built, "tiny": tiny}
    if wheels:
        summary["wheels"] = download_wheels(out / "wheels")
    write_json(out / "prepared.json", summary, newline=True)
    return summary
