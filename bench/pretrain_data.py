"""The example sets the pretraining benchmarks train on, cut by lmpipe's own stages.

From the real texts of ../shared/data (the four Gutenberg books and Tiny Shakespeare, one
document per file, and the 1,000 IMDB reviews), through the ingest, tokenizer, encode and
examples stages on a local Ray: BERT examples of 128 tokens (WordPiece, 30,522 tokens) for
bench/pretrain_throughput.py and bench/pretrain_gpu.py, and GPT-2 blocks of 1,024 tokens
(byte-level BPE) for the latter. Every stage reuses a complete output with the same
fingerprint, so a rerun is quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import SHARED
from pretrain_arms import SEED

WORKERS = 2  # the local Ray's workers (the CPU benchmark's two cores)
SEQ_LEN = 128  # BERT examples' length
VOCAB = 30_522  # BERT's WordPiece vocabulary
GPT2_BLOCK = 1024
GPT2_VOCAB = 50_257  # GPT-2's published vocabulary


def ingest_shared_texts(ws: Path, ray_cfg: Any) -> Any:
    """Ingest the real texts of ../shared/data (a book is one document) into workspace `ws`."""
    from tasks.ingest.ingest import IngestConfig
    from tasks.ingest.stage import run_ingest

    books = {"format": "txt", "txt_mode": "file"}  # a book is one document: full 128-token rows
    return run_ingest(
        IngestConfig.model_validate(
            {
                "sources": [
                    {"path": str(SHARED / "gutenberg_books"), **books},
                    {"path": str(SHARED / "tiny_shakespeare" / "input.txt"), **books},
                    {"path": str(SHARED / "imdb_sample" / "texts.csv"), "format": "csv"},
                ],
                "max_chars": 2_000_000,  # Tiny Shakespeare is 1.1 M characters
            }
        ),
        ray_cfg,
        ws,
    )


def run_stages(work: Path, tokenizer_cfg: Any, examples_cfg: Any) -> tuple[Any, Any, Any]:
    """Run ingest, tokenizer, encode and examples in `work`/ws; return three stages' results.

    Returns the ingest's, the tokenizer's and the examples' results; the local Ray is shut
    down after them.
    """
    from tasks.common.ray_runtime import RayConfig
    from tasks.encode.encode import EncodeConfig
    from tasks.encode.stage import run_encode
    from tasks.examples.stage import run_examples
    from tasks.tokenizer.stage import run_tokenizer

    ray_cfg, ws = RayConfig(num_workers=WORKERS), work / "ws"
    ingest = ingest_shared_texts(ws, ray_cfg)
    tokenizer = run_tokenizer(tokenizer_cfg, ingest.path, ws)
    encode = run_encode(EncodeConfig(), ray_cfg, ingest.path, tokenizer.path, ws)
    examples = run_examples(examples_cfg, SEED, ray_cfg, encode.path, tokenizer.path, ws)
    import ray

    ray.shutdown()
    return ingest, tokenizer, examples


def prepare_examples(work: Path) -> dict[str, Any]:
    """Ingest the real texts, train the WordPiece tokenizer, encode, cut BERT examples."""
    from tasks.examples.config import ExamplesConfig
    from tasks.tokenizer.tokenizer import TokenizerConfig

    # min_frequency 1: the corpus (4.4 M characters) reaches 28,573 tokens at the default 2.
    tok_cfg = TokenizerConfig(family="wordpiece", vocab_size=VOCAB, min_frequency=1)
    cfg = ExamplesConfig(objective="bert", max_seq_length=SEQ_LEN)
    ingest, tokenizer, examples = run_stages(work, tok_cfg, cfg)
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


def prepare_gpt2_blocks(work: Path) -> dict[str, Any]:
    """Byte-level BPE on the shared texts, then causal blocks of 1,024 tokens."""
    from tasks.examples.config import ExamplesConfig
    from tasks.tokenizer.tokenizer import TokenizerConfig

    tok_cfg = TokenizerConfig(family="bpe", bpe_style="gpt2", vocab_size=GPT2_VOCAB)
    cfg = ExamplesConfig(objective="causal", block_size=GPT2_BLOCK)
    _, tokenizer, examples = run_stages(work, tok_cfg, cfg)
    return {
        "examples_dir": str(examples.path),
        "tokenizer_dir": str(tokenizer.path),
        "vocab_size": tokenizer.manifest["metrics"]["vocab_size"],
        "train_examples": examples.manifest["splits"]["train"]["rows"],
    }
