"""Loss guards: a NaN/inf loss or a spike over the running mean skips the step or stops the run.

Every rank must take the same decision, so the check all-reduces one small tensor per
micro-batch (the loss sum and a non-finite flag).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Literal

import torch
import torch.distributed as dist

from training.config import GuardConfig

Verdict = Literal["ok", "skip"]


class TrainingDivergedError(RuntimeError):
    """The loss went non-finite or spiked and the guard is set to stop."""


class LossGuard:
    """Tracks the running mean of accepted losses and judges each micro-batch's loss."""

    def __init__(self, cfg: GuardConfig) -> None:
        """Start with an empty history."""
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.spike_window)
        self.skipped_in_row = 0
        self.skipped_total = 0

    def check(self, loss: torch.Tensor, step: int) -> Verdict:
        """Judge the mean of `loss` over all ranks; raise when the policy is to stop."""
        probe = torch.stack(
            [loss.float().nan_to_num(0.0, 0.0, 0.0), (~torch.isfinite(loss)).float()]
        )
        if dist.is_initialized():
            dist.all_reduce(probe)
            probe[0] /= dist.get_world_size()
        value, nonfinite = float(probe[0]), bool(probe[1] > 0)
        if nonfinite:
            return self._act(self.cfg.on_nonfinite, f"non-finite loss at step {step + 1}")
        factor = self.cfg.spike_factor
        if factor is not None and len(self.history) >= min(5, self.cfg.spike_window):
            mean = sum(self.history) / len(self.history)
            if value > factor * mean:
                reason = f"loss spike at step {step + 1}: {value:.4g} > {factor} x {mean:.4g}"
                return self._act(self.cfg.on_spike, reason)
        self._pending = value
        return "ok"

    def _act(self, policy: str, reason: str) -> Verdict:
        if policy == "stop":
            raise TrainingDivergedError(
                f"{reason}; stopping (train.guard policy 'stop'). Resume from the last "
                "checkpoint with a lower train.optim.lr, or set the guard to 'skip'."
            )
        if self.skipped_in_row + 1 > self.cfg.max_skips:
            raise TrainingDivergedError(
                f"{reason}; {self.cfg.max_skips} steps in a row skipped already "
                "(train.guard.max_skips): stopping"
            )
        return "skip"

    def step_done(self, skipped: bool) -> None:
        """Close a step: count a skip, or add its loss to the running mean."""
        if skipped:
            self.skipped_in_row += 1
            self.skipped_total += 1
        else:
            self.skipped_in_row = 0
            pending = getattr(self, "_pending", math.nan)
            if math.isfinite(pending):
                self.history.append(pending)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run judges losses exactly as before."""
        return {
            "history": list(self.history),
            "skipped_in_row": self.skipped_in_row,
            "skipped_total": self.skipped_total,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned."""
        self.history = deque(state["history"], maxlen=self.cfg.spike_window)
        self.skipped_in_row = state["skipped_in_row"]
        self.skipped_total = state["skipped_total"]
