"""Intrinsic evaluation of a pretrained model: held-out loss, probes and generation samples.

- `heldout_metrics`: perplexity / masked-LM accuracy / NSP accuracy on the examples' validation
  (or test) split, through the same batch builder and loss as pretraining
  (`training/pretrain/data.py`, `training/pretrain/losses/`), so the numbers are comparable with
  the training curve.
- `fill_mask_probes`: the top-k fillers of `[MASK]` in sentences such as "The [MASK] sat on
  the mat." (the placeholder becomes the tokenizer's own mask token).
- `generation_samples`: continuations of prompts (GPT) or text-to-text outputs (T5) under each
  decoding setting (greedy, temperature, top-k, top-p).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from training.evaluate.config import IntrinsicConfig
from training.pretrain.data import (
    EVAL_EPOCH,
    BatchBuilder,
    ExampleShards,
    dynamic_masker,
    read_manifest,
)
from training.pretrain.losses import pretraining_loss
from training.pretrain.telemetry import StepMeter, metrics_from
from training.scoring.config import GenerationSettings
from training.scoring.generation import generate_texts

log = logging.getLogger(__name__)

MASK_PLACEHOLDER = "[MASK]"


def heldout_metrics(
    model: PreTrainedModel,
    examples_dir: Path,
    tokenizer_dir: Path,
    seed: int,
    cfg: IntrinsicConfig,
) -> dict[str, float]:
    """Loss, perplexity and accuracies of `model` on held-out pretraining examples."""
    manifest = read_manifest(examples_dir)
    data = ExampleShards(examples_dir, cfg.heldout_split, verify=False)
    build = BatchBuilder(
        manifest["objective"],
        dynamic_masker(manifest, tokenizer_dir, seed),
        False,
    )
    sparse = manifest["objective"] in ("bert", "sop", "roberta")
    meter = StepMeter()
    n = min(len(data), cfg.heldout_max_samples)
    model.train(False)
    with torch.no_grad():
        for start in range(0, n, cfg.batch_size):
            ids = np.arange(start, min(n, start + cfg.batch_size))
            batch = build(data.take(ids), ids, EVAL_EPOCH)
            meter.add(pretraining_loss(model, manifest["objective"], batch, sparse), batch)
    return {**metrics_from(meter.totals()), "heldout_examples": float(n)}


def fill_mask_probes(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], top_k: int
) -> list[dict[str, Any]]:
    """The `top_k` most probable fillers (token, probability) of each text's mask."""
    mask = tokenizer.mask_token
    if mask is None:
        raise ValueError("fill-mask probes need a tokenizer with a mask token")
    out = []
    model.train(False)
    for text in texts:
        if MASK_PLACEHOLDER not in text:
            raise ValueError(f"fill-mask probe {text!r} has no {MASK_PLACEHOLDER}")
        enc = tokenizer(text.replace(MASK_PLACEHOLDER, mask), return_tensors="pt")
        where = (enc["input_ids"][0] == tokenizer.mask_token_id).nonzero()[:, 0]
        with torch.no_grad():
            logits = _mlm_logits(model, enc)  # (1, T, V)
        probs = logits[0, where[0]].softmax(-1)
        top = probs.topk(top_k)
        fillers = [
            {"token": tokenizer.convert_ids_to_tokens(int(i)), "probability": float(p)}
            for p, i in zip(top.values, top.indices, strict=True)
        ]
        out.append({"text": text, "fillers": fillers})
    return out


def _mlm_logits(model: PreTrainedModel, enc: Any) -> torch.Tensor:
    outputs = model(**{k: v for k, v in enc.items() if k != "token_type_ids" or v is not None})
    # BertForPreTraining returns prediction_logits; masked-LM classes return logits.
    logits = getattr(outputs, "prediction_logits", None)
    return torch.as_tensor(logits if logits is not None else outputs.logits)


def generation_samples(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    decodings: list[GenerationSettings],
) -> list[dict[str, Any]]:
    """Each prompt's output under each decoding setting."""
    rows = []
    for settings in decodings:
        texts = generate_texts(model, tokenizer, prompts, settings)
        label = settings.model_dump(exclude_defaults=True) or {"strategy": "greedy"}
        rows += [
            {"decoding": label, "prompt": p, "output": t}
            for p, t in zip(prompts, texts, strict=True)
        ]
    return rows


def sentence_embeddings(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], batch_size: int
) -> np.ndarray:
    """Mean-pooled last hidden states over each text's real tokens, (N, D).

    Encoders and decoders pool their last layer; T5 pools its encoder's.
    """
    out = []
    encoder = model.get_encoder() if model.config.is_encoder_decoder else model
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.train(False)
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            # Padded by hand: GPT-2 style vocabularies have no pad token (eos pads, masked out).
            rows = tokenizer(texts[start : start + batch_size], truncation=True)["input_ids"]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), int(pad))  # (B, T)
            mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
            hidden = encoder(
                input_ids=ids, attention_mask=mask, output_hidden_states=True
            ).hidden_states[-1]  # (B, T, D)
            weights = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            out.append(((hidden * weights).sum(1) / weights.sum(1).clamp_min(1)).float().numpy())
    return np.concatenate(out)
