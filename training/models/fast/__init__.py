"""Faster training paths for the stock transformers classes (`model.implementation: fast`).

A fast class is a subclass of the family's transformers pretraining class with the same
parameters under the same names: the same checkpoints, the same initialisation, and an export
that is the stock class itself (`build_export_model` builds the stock class and loads the run's
weights by name). Only `forward` paths change, for the calls pretraining's losses make (ids
and the masks they pass; no FlexAttention block mask, activation checkpointing, cache or
attention outputs); every other call falls back to the stock forward. Each family's module is
imported only when that family is built. docs/models.md, "Fast paths", says what each one
changes and why.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

#: family -> (module under training.models.fast, class name)
FAST_CLASSES: dict[str, tuple[str, str]] = {
    "bert": ("bert", "FastBertForPreTraining"),
    "gpt2": ("gpt2", "FastGPT2LMHeadModel"),
}


def fast_class(family: str) -> type[Any] | None:
    """The family's fast subclass, or None where it has none."""
    entry = FAST_CLASSES.get(family)
    if entry is None:
        return None
    module = importlib.import_module(f"training.models.fast.{entry[0]}")
    return getattr(module, entry[1])  # type: ignore[no-any-return]


def stock_class(model: Any) -> type[Any]:
    """The transformers class `model` is (or whose fast subclass it is)."""
    return next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))


def as_stock(model: Any) -> Any:
    """`model` as its stock transformers class: itself, or a copy with its config and weights.

    What `save_pretrained` writes names the instance's class (`architectures`), so an export
    of a fast module goes through here to stay a stock checkpoint.
    """
    stock = stock_class(model)
    if type(model) is stock:
        return model
    # The same config object: what `save_pretrained` writes into it (`architectures`, `dtype`)
    # is the trained model's, as when the stock class saves itself.
    with torch.random.fork_rng(devices=[]):  # its throwaway initialisation draws nothing of ours
        twin = stock(model.config).to(dtype=model.dtype)
    twin.load_state_dict(model.state_dict())
    return twin.train(model.training)
