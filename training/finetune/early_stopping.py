"""Early stopping on a validation metric, keeping the best epoch's weights to restore at the end.

`EarlyStopping.update(epoch, value, model)` is called once per epoch after validation; it says
whether the metric improved and whether to stop, and on an improvement snapshots the weights
that can change (trainable parameters and buffers) to CPU. `restore(model)` loads that snapshot
back, so the model the loop exports is the best epoch's. Semantics (the Keras/Lightning ones):
training stops after `patience` epochs in a row without an improvement of more than
`min_delta`; epochs are 0-based. Worked example: docs/strategies.md ("Early stopping").
Not here: computing the metric (the evaluator) and checkpoints (`training/runtime/checkpoint.py`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """What one epoch's validation value means: a new best, and whether to stop now."""

    improved: bool
    stop: bool


class EarlyStopping:
    """Watch one validation metric; stop after `patience` epochs without improvement."""

    def __init__(
        self,
        metric: str,
        higher_is_better: bool = True,
        patience: int = 3,
        min_delta: float = 0.0,
    ) -> None:
        """Watch `metric`; an improvement must beat the best by more than `min_delta`.

        Raises:
            ValueError: patience below 1 or a negative `min_delta`.
        """
        if patience < 1 or min_delta < 0:
            raise ValueError(f"need patience >= 1 and min_delta >= 0, got {patience}, {min_delta}")
        self.metric, self.higher_is_better = metric, higher_is_better
        self.patience, self.min_delta = patience, min_delta
        self.best_value: float | None = None
        self.best_epoch: int | None = None
        self.best_checkpoint: Path | None = None
        self.bad_epochs = 0
        self.last_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self._best_state: dict[str, torch.Tensor] | None = None

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        gain = value - self.best_value if self.higher_is_better else self.best_value - value
        return gain > self.min_delta

    def update(
        self,
        epoch: int,
        value: float,
        model: torch.nn.Module | None = None,
        checkpoint: Path | None = None,
    ) -> Decision:
        """Record `epoch`'s validation `value`; on a new best keep `model`'s weights.

        Args:
            epoch: 0-based epoch, larger than the last one given.
            value: The metric; NaN or infinity never counts as an improvement.
            model: Snapshot its changeable weights on an improvement (to CPU).
            checkpoint: Or remember where the loop saved this epoch (e.g. under ZeRO-3, where
                a module's state dict holds only this rank's shards).

        Raises:
            ValueError: `epoch` does not come after the previous one.
        """
        if self.last_epoch is not None and epoch <= self.last_epoch:
            raise ValueError(f"epoch {epoch} does not follow epoch {self.last_epoch}")
        self.last_epoch = epoch
        improved = self._improves(float(value))
        if not math.isfinite(float(value)):
            log.warning("epoch %d: %s is %s, counted as no improvement", epoch, self.metric, value)
        if improved:
            self.best_value, self.best_epoch, self.bad_epochs = float(value), epoch, 0
            self.best_checkpoint = checkpoint
            self._best_state = snapshot(model) if model is not None else None
        else:
            self.bad_epochs += 1
        stop = self.bad_epochs >= self.patience
        if stop:
            self.stopped_epoch = epoch
            log.info(
                "early stop at epoch %d: best %s %s at epoch %s",
                epoch,
                self.metric,
                self.best_value,
                self.best_epoch,
            )
        return Decision(improved=improved, stop=stop)

    def restore(self, model: torch.nn.Module) -> bool:
        """Load the best epoch's snapshot into `model`; False if there is none to load.

        Raises:
            RuntimeError: the snapshot does not fit `model` (names a key).
        """
        if self._best_state is None:
            return False
        result = model.load_state_dict(self._best_state, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(
                f"best-epoch snapshot has keys {result.unexpected_keys[:5]} the model lacks"
            )
        return True

    def state_dict(self) -> dict[str, Any]:
        """The counters (not the weights snapshot) for a checkpoint's metadata."""
        keys = ("best_value", "best_epoch", "bad_epochs", "last_epoch", "stopped_epoch")
        state = {key: getattr(self, key) for key in keys}
        state["best_checkpoint"] = str(self.best_checkpoint) if self.best_checkpoint else None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the counters saved by `state_dict`."""
        for key in ("best_value", "best_epoch", "bad_epochs", "last_epoch", "stopped_epoch"):
            setattr(self, key, state[key])
        saved = state.get("best_checkpoint")
        self.best_checkpoint = Path(saved) if saved else None


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the state entries that training can change: trainable params and buffers.

    Frozen parameters are left out (they cannot differ from the model's own at restore time),
    so a LoRA or adapter run copies only its few trainable tensors.
    """
    changeable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    changeable |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return {
        key: value.detach().to("cpu", copy=True)
        for key, value in model.state_dict().items()
        if key in changeable
    }
