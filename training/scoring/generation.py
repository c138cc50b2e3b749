"""Text generation with explicit, seeded decoding settings, for samples and evaluation.

Here: `GenerationSettings` (the decoding section: greedy or sampling with temperature, top-k,
top-p, beams, a length limit and a seed) and `generate_texts`, which decodes a list of prompts
in batches (left padding for decoder-only models, the source as encoder input for T5), stops
each text at eos and returns only the new text. Used for generation samples, causal-LM
evaluation and seq2seq BLEU/ROUGE predictions. Not here: scoring labels
(`training/evaluate/prompting.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from training.models.tokens import causal_bos, pad_id
from training.scoring.config import GenerationSettings as GenerationSettings


def generation_config(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: GenerationSettings
) -> GenerationConfig:
    """The model's generation config with `settings` applied and the tokenizer's pad/eos ids."""
    config = copy.deepcopy(model.generation_config)
    fields: dict[str, Any] = {
        "do_sample": settings.strategy == "sample",
        "num_beams": settings.num_beams,
        "max_new_tokens": settings.max_new_tokens,
        "max_length": None,
        "pad_token_id": pad_id(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        # greedy ignores these; set them neutral so transformers has nothing to warn about
        "temperature": settings.temperature if settings.strategy == "sample" else 1.0,
        "top_k": (settings.top_k or None) if settings.strategy == "sample" else None,
        "top_p": settings.top_p if settings.strategy == "sample" else 1.0,
    }
    config.update(**fields)  # type: ignore[no-untyped-call]
    return config


def _positions(model: PreTrainedModel) -> int | None:
    """Positions the model's position table holds (None: relative positions, no limit)."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(model.config, name, None)
        if value is not None:
            return int(value)
    return None


def _left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (B, T), padded on the left."""
    width = max(len(row) for row in rows)
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def _decoder_inputs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    settings: GenerationSettings,
) -> list[list[int]]:
    """Prompt ids of a decoder-only model: bos (if any) + prompt, cut to leave room to generate."""
    bos = causal_bos(tokenizer)
    rows = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    positions = _positions(model)
    room = None if positions is None else positions - settings.max_new_tokens - len(bos)
    if room is not None and room < 1:
        raise ValueError(
            f"max_new_tokens {settings.max_new_tokens} leaves no room for a prompt in the "
            f"model's {positions} positions"
        )
    return [bos + (row if room is None else row[-room:]) for row in rows]


def _batch_inputs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    settings: GenerationSettings,
) -> dict[str, torch.Tensor]:
    """Model inputs of one batch of prompts, on the model's device."""
    if model.config.is_encoder_decoder:  # the prompt is the encoder input, with its specials
        # Cut to the encoder's position table too (BART's; T5 has none), whatever the
        # tokenizer's own model_max_length says.
        limit = _positions(model)
        enc = tokenizer(
            list(prompts), padding=True, truncation=True, max_length=limit, return_tensors="pt"
        )
        ids, mask = enc["input_ids"], enc["attention_mask"]
    else:
        ids, mask = _left_padded(
            _decoder_inputs(model, tokenizer, prompts, settings), pad_id(tokenizer)
        )
    return {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}


def _new_text(tokenizer: PreTrainedTokenizerBase, row: torch.Tensor, eos: int | None) -> str:
    """Decode generated ids up to (not including) the first eos."""
    ids = row.tolist()
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos)]
    return str(tokenizer.decode(ids, skip_special_tokens=True)).strip()


def generate_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    settings: GenerationSettings,
) -> list[str]:
    """Continue each prompt (decoder-only) or answer each source (T5); return only new text.

    Prompts are decoded `settings.batch_size` at a time. A decoder-only model gets bos (where
    the vocabulary has its own) + the prompt, padded on the left so every prompt ends where
    generation starts, and the prompt's start is cut if it would leave no room for
    `max_new_tokens`. T5 gets the prompt as encoder input (give it its task prefix). Each text
    ends before its first eos, special tokens removed, stripped. Sampling is seeded with
    `settings.seed` inside a forked RNG, so the global torch RNG is left as it was and the same
    prompts and settings give the same texts. The model's train/eval mode is restored.
    """
    config = generation_config(model, tokenizer, settings)
    devices = [model.device.index or 0] if model.device.type == "cuda" else []
    texts: list[str] = []
    was_training = model.training
    model.train(False)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(settings.seed)
            for start in range(0, len(prompts), settings.batch_size):
                batch = _batch_inputs(
                    model, tokenizer, prompts[start : start + settings.batch_size], settings
                )
                # (B, T_prompt + T_new) for decoder-only models, (B, 1 + T_new) for T5 and BART
                out = model.generate(**batch, generation_config=config)  # type: ignore[operator]
                if not model.config.is_encoder_decoder:
                    out = out[:, batch["input_ids"].shape[1] :]  # drop the prompt
                else:  # drop the decoder start: T5's pad, but BART's is eos (`</s>`)
                    out = out[:, 1:]
                texts += [_new_text(tokenizer, row, tokenizer.eos_token_id) for row in out]
    finally:
        model.train(was_training)
    return texts
