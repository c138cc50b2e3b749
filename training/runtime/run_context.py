"""The run context: what every training, fine-tuning and evaluation stage runs under.

`RunContext` holds the five things a stage shares with every other stage of one run (the
workspace, the run seed, where Ray runs, the MLflow settings and the run's name), so a stage
takes it as one keyword argument instead of five positional ones. The stage's own inputs and
config section stay separate arguments. It imports no torch: the flows build it before they
know which stage runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.common.ray_runtime import RayConfig
from training.tracking.runs import TrackingConfig


@dataclass(frozen=True)
class RunContext:
    """Where and as what a stage runs: workspace, seed, Ray, tracking and the run's name.

    Attributes:
        workspace: The directory that holds every stage output and training run.
        seed: The run seed (data order, new heads, masking).
        ray: Where Ray runs.
        tracking: MLflow settings.
        name: The run's name: MLflow run name prefix and default registered-model prefix.
    """

    workspace: Path
    seed: int
    ray: RayConfig
    tracking: TrackingConfig
    name: str

    @property
    def tracking_uri(self) -> str | None:
        """The MLflow tracking URI the workers log to, or None when tracking is off."""
        return self.tracking.tracking_uri if self.tracking.enabled else None
