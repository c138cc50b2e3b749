"""What deterministic WordPiece training costs: lmpipe's trainer against upstream's, same texts.

Usage: python bench/tokenizer_determinism.py [--mb 10] [--vocab 30000] [--repeat 3]

Reads the real texts in ../shared/data (the Gutenberg books, Tiny Shakespeare, the IMDB sample),
repeated in order up to --mb MiB of documents (one paragraph each), into a Python list; then,
interleaved, --repeat times each:

- upstream: `tokenizers`' `WordPieceTrainer` called once with lmpipe's WordPiece pipeline
  (BERT normaliser and pre-tokeniser), as lmpipe trained before: not reproducible run to run;
- lmpipe: `train_tokenizer` (the alphabet-only pass that finds the `##` continuation pieces,
  then the training with them listed after the specials: the same bytes in every process).

Prints each arm's times, the medians and their ratio (lmpipe / upstream). Both arms use every
core (Rayon's default).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tokenizers import trainers as tk_trainers

from tasks.tokenizer.tokenizer import (
    TokenizerConfig,
    special_tokens,
    train_tokenizer,
    untrained_tokenizer,
)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def corpus(mib: int) -> list[str]:
    """Paragraphs of the shared texts, repeated in order up to `mib` MiB."""
    files = sorted((DATA / "gutenberg_books").glob("*.txt"))
    files += [DATA / "tiny_shakespeare" / "input.txt"]
    paragraphs = [
        p.strip()
        for path in files
        for p in path.read_text(encoding="utf-8").split("\n\n")
        if p.strip()
    ]
    out: list[str] = []
    size = 0
    while size < mib << 20:
        for p in paragraphs:
            out.append(p)
            size += len(p.encode())
            if size >= mib << 20:
                break
    return out


def upstream(texts: list[str], cfg: TokenizerConfig) -> float:
    """Seconds for one upstream WordPiece training of `texts`."""
    tok = untrained_tokenizer(cfg)
    trainer = tk_trainers.WordPieceTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=special_tokens(cfg),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    start = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer)
    return time.perf_counter() - start


def deterministic(texts: list[str], cfg: TokenizerConfig) -> float:
    """Seconds for one lmpipe WordPiece training of `texts`."""
    start = time.perf_counter()
    train_tokenizer(texts, cfg)
    return time.perf_counter() - start


def main() -> None:
    """Run the interleaved arms and print their times and ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=30_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    texts = corpus(args.mb)
    cfg = TokenizerConfig(family="wordpiece", vocab_size=args.vocab)
    print(f"{len(texts):,} documents, {sum(len(t.encode()) for t in texts) / 2**20:.1f} MiB")
    times: dict[str, list[float]] = {"upstream": [], "lmpipe": []}
    for _ in range(args.repeat):
        times["upstream"].append(upstream(texts, cfg))
        times["lmpipe"].append(deterministic(texts, cfg))
    for arm, values in times.items():
        listed = ", ".join(f"{v:.2f}" for v in values)
        print(f"{arm}: median {statistics.median(values):.2f} s ({listed})")
    ratio = statistics.median(times["lmpipe"]) / statistics.median(times["upstream"])
    print(f"ratio lmpipe / upstream: {ratio:.3f}")


if __name__ == "__main__":
    main()
