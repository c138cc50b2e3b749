"""Models without biases (`model.bias: false`): every bias zero, frozen, and marked so.

nanoGPT trains its GPT-2 without biases (`bias=False`): fewer tensors for the optimizer and the
clip, and no bias gradients to reduce. lmpipe keeps the stock class, so that the export stays a
stock checkpoint: the biases stay parameters, at zero and not trained, and the model carries a
mark that a fast path reads to leave them out of the computation (adding a zero changes no
value, so the stock forward and the export give the same logits).
"""

from __future__ import annotations

import torch
from torch import nn

#: The instance attribute that marks a model whose biases are all zero and frozen. An attribute
#: of the module, not of its config: nothing of it reaches a checkpoint or an export.
ZERO_BIASES = "lmpipe_zero_biases"


def drop_biases(model: nn.Module) -> None:
    """Zero and freeze every parameter named `bias` in `model`, and mark the model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] == "bias":
                param.zero_()
                param.requires_grad_(False)
    setattr(model, ZERO_BIASES, True)


def has_zero_biases(model: nn.Module) -> bool:
    """Whether `drop_biases` marked `model`."""
    return bool(getattr(model, ZERO_BIASES, False))
