"""What the training arms of the two pretraining benchmarks share.

bench/pretrain_throughput.py (CPU) and bench/pretrain_gpu.py (GPU) compare lmpipe's loop with
plain loops that train the same model on the same batches: every arm builds its model seeded,
as `training.pretrain.loop.Worker` builds it (`seeded_model`), takes the loop's own batches
(`loop_batches`: its seeded global order over the train split, built by its `BatchBuilder`),
and counts real input tokens (`real_tokens`); lmpipe's arms run the loop itself as a
`WorkerJob` (`worker_job`).

Only the standard library is imported at the top (torch and lmpipe where they are used), as in
the benchmark scripts, whose driver processes never train.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

SEED = 0  # the examples' cut, the loop's global order and every arm's initial weights


def loop_batches(
    examples_dir: Path, batch_size: int, steps: int, document_masking: bool = False
) -> Iterator[dict[str, Any]]:
    """Yield the loop's first `steps` global batches of `batch_size` examples.

    The loop's seeded global order over the train split (memory-mapped, as the loop opens
    it), each batch built by its builder; static masks are in the shards.
    """
    from training.pretrain.data import (
        BatchBuilder,
        Cursor,
        ExampleShards,
        GlobalOrder,
        read_manifest,
    )

    manifest = read_manifest(examples_dir)
    train = ExampleShards(examples_dir, "train", verify=False)
    order = GlobalOrder(len(train), SEED, batch_size)
    build = BatchBuilder(manifest["objective"], None, document_masking)
    cursor = Cursor()
    for _ in range(steps):
        epoch, indices, cursor = order.next_batch(cursor)
        yield build(train.take(indices), indices, epoch)


def real_tokens(batch: dict[str, Any]) -> Any:
    """Real input tokens of a batch: its 2-D padding mask's sum, else every position.

    A batch without padding carries no mask (training.pretrain.data.BatchBuilder), and a
    document-masked one a (B, 1, L, L) mask: every position of both is real.
    """
    if "attention_mask" in batch and batch["attention_mask"].dim() == 2:
        return batch["attention_mask"].sum().item()
    return batch["input_ids"].numel()


def seeded_model(
    section: Any, objective: str, manifest: dict[str, Any], length: int, stock: bool = False
) -> Any:
    """Build the model of `section`, seeded, exactly as `training.pretrain.loop.Worker` does.

    `stock`: transformers' own class rather than lmpipe's fast subclass of it (the same
    initial weights under the seed); the plain arms train it, as a user's own loop would.
    """
    import torch

    from training.models.models import build_model

    specials = manifest["specials"]
    torch.manual_seed(SEED)
    vocab = specials["vocab_size"]
    return build_model(section, objective, vocab, specials, length, stock=stock)


def worker_job(train: Any, spec: dict[str, Any], config_hash: str) -> Any:
    """Return the loop's job for a setting: its train config, the seed, its examples."""
    from training.pretrain.loop import WorkerJob

    return WorkerJob(
        train=train,
        seed=SEED,
        examples_dir=Path(spec["examples_dir"]),
        tokenizer_dir=Path(spec["tokenizer_dir"]),
        config_hash=config_hash,
    )
