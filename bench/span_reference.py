"""The T5 reference arm of bench/time_to_quality.py: a plain loop over T5ForConditionalGeneration.

Run as `python bench/span_reference.py --child SPEC` (bench/time_to_quality.py --family t5
does). What it does, all of it timed (the parent's clock runs from the spawn of this process):

- data: the train split's token ids as lmpipe's encode stage wrote them for the recipe (the
  same token stream as lmpipe's arm, with lmpipe's SentencePiece Unigram tokenizer, encoded
  once by the bench's untimed set-up), each shard's documents concatenated without separators
  and cut into raw chunks of the length T5's arithmetic gives (`compute_input_and_target_lengths`
  of transformers' examples/flax/language-modeling/run_t5_mlm_flax.py: 141 raw tokens for 128
  inputs at density 0.15 and mean span length 3), the tail dropped, as T5 and lmpipe cut;
- batches: the chunks in a new shuffled order every epoch (the tail of an epoch dropped), each
  batch span-corrupted anew with run_t5_mlm_flax's `DataCollatorForT5MLM` written in NumPy
  (`random_spans_noise_mask` per row, sentinels counting down from `<extra_id_0>`, EOS after
  inputs and targets), at the recipe's noise density and mean span length;
- the model: `T5ForConditionalGeneration` of lmpipe's config for the recipe, its weights drawn
  after `torch.manual_seed(seed)` as lmpipe draws them, and bench/plain_reference.py's loop
  (`model(input_ids=..., labels=...).loss`; the model shifts the labels right itself);
- evaluations every `eval_every` steps (and at step 0) on the fixed validation batch (lmpipe's
  validation examples, their spans fixed by its example stage), with `span_loss`, the function
  that also evaluates lmpipe's checkpoints.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_reference import Batch, build_model, run_child
from time_to_quality import read_arrow


def compute_input_and_target_lengths(
    inputs_length: int, noise_density: float, mean_noise_span_length: float
) -> tuple[int, int]:
    """Raw tokens per example and the targets' length (run_t5_mlm_flax, after T5)."""

    def lengths(tokens: int) -> tuple[int, int]:
        noise = round(tokens * noise_density)
        spans = round(noise / mean_noise_span_length)
        return tokens - noise + spans + 1, noise + spans + 1

    tokens = inputs_length
    while lengths(tokens + 1)[0] <= inputs_length:
        tokens += 1
    targets = lengths(tokens)[1]
    if noise_density == 0.5 and targets > inputs_length:
        tokens, targets = tokens - 1, targets - 1
    return tokens, targets


def random_segmentation(items: int, segments: int, rng: np.random.Generator) -> np.ndarray:
    """(segments,) positive lengths summing to `items`, uniform over the compositions."""
    first = np.arange(items - 1) < (segments - 1)
    rng.shuffle(first)
    segment_id = np.cumsum(np.pad(first, [[1, 0]]))
    return np.unique(segment_id, return_counts=True)[1]


def random_spans_noise_mask(
    length: int, density: float, mean_span: float, rng: np.random.Generator
) -> np.ndarray:
    """(length,) bool: noise spans, the first span not noise (run_t5_mlm_flax's)."""
    noise = min(max(round(length * density), 1), length - 1)
    spans = max(round(min(noise, length - noise) / mean_span), 1)
    noise_lengths = random_segmentation(noise, spans, rng)
    kept_lengths = random_segmentation(length - noise, spans, rng)
    interleaved = np.stack([kept_lengths, noise_lengths], axis=1).reshape(-1)  # (2 * spans,)
    starts = np.zeros(length, dtype=np.int8)
    starts[np.cumsum(interleaved)[:-1]] = 1
    return np.asarray(np.cumsum(starts) % 2 == 1)


def sentinel_ids(mask: np.ndarray, sentinel_top: int) -> np.ndarray:
    """(N, L): a span's first token -> its sentinel, its others -> -1, the rest -> 0."""
    mask = mask.astype(np.int64)
    start = mask - np.roll(mask, 1, axis=-1) * mask
    start[:, 0] = mask[:, 0]
    ids = np.where(start != 0, np.cumsum(start, axis=-1), 0)
    ids = np.where(ids != 0, sentinel_top + 1 - ids, 0)  # k-th span: <extra_id_k>
    return np.asarray(ids - (mask - start))


def filter_input_ids(ids: np.ndarray, sentinels: np.ndarray, eos: int) -> np.ndarray:
    """Replace spans by their sentinel, drop their other tokens, and end each row with EOS."""
    full = np.where(sentinels != 0, sentinels, ids)
    kept = full[full >= 0].reshape(len(ids), -1)
    return np.concatenate([kept, np.full((len(ids), 1), eos, dtype=kept.dtype)], axis=-1)


def corrupt(chunks: np.ndarray, spec: dict[str, Any], rng: np.random.Generator) -> Batch:
    """Span-corrupt raw `chunks` (N, R): encoder `input_ids` (N, I) and `labels` (N, T)."""
    recipe = spec["recipe"]
    mask = np.stack(
        [
            random_spans_noise_mask(
                chunks.shape[1], recipe["noise_density"], recipe["mean_span"], rng
            )
            for _ in range(len(chunks))
        ]
    )  # (N, R)
    inputs = filter_input_ids(chunks, sentinel_ids(mask, spec["sentinel_top"]), spec["eos"])
    labels = filter_input_ids(chunks, sentinel_ids(~mask, spec["sentinel_top"]), spec["eos"])
    return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels)}


def read_chunks(encode_dir: Path, raw_length: int) -> np.ndarray:
    """(N, raw_length) int64: each train shard's documents concatenated, cut, the tail dropped."""
    import pyarrow.compute as pc

    manifest = json.loads((encode_dir / "manifest.json").read_text())
    chunks = []
    for entry in manifest["splits"]["train"]["shards"]:
        column = read_arrow(encode_dir / entry["name"]).column("token_ids").combine_chunks()
        stream = pc.list_flatten(pc.list_flatten(column)).to_numpy().astype(np.int64)
        n = len(stream) // raw_length
        chunks.append(stream[: n * raw_length].reshape(n, raw_length))
    return np.concatenate(chunks)


def batches(spec: dict[str, Any], chunks: np.ndarray) -> Iterator[Batch]:
    """Corrupted batches of `chunks`, epoch after epoch, each epoch in a new shuffled order."""
    rng = np.random.default_rng(spec["seed"])
    size = spec["recipe"]["batch"]
    while True:
        order = rng.permutation(len(chunks))
        for start in range(0, len(order) - size + 1, size):
            yield corrupt(chunks[order[start : start + size]], spec, rng)


def prepare(spec: dict[str, Any]) -> tuple[torch.nn.Module, Iterator[Batch]]:
    """The model and the batch stream of the T5 reference arm."""
    import transformers as tf

    recipe = spec["recipe"]
    model = build_model(spec, tf.T5ForConditionalGeneration)
    tokenizer = tf.AutoTokenizer.from_pretrained(spec["tokenizer"])
    spec = spec | {
        "sentinel_top": tokenizer.convert_tokens_to_ids("<extra_id_0>"),
        "eos": tokenizer.eos_token_id,
    }
    raw, _ = compute_input_and_target_lengths(
        recipe["length"], recipe["noise_density"], recipe["mean_span"]
    )
    return model, batches(spec, read_chunks(Path(spec["encode"]), raw))


if __name__ == "__main__":
    run_child(prepare)
