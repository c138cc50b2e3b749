"""The loss-curve PNG of a training run, drawn from its per-step log (all attempts merged)."""

from __future__ import annotations

import json
from pathlib import Path


def step_history(steps_file: Path) -> dict[int, dict[str, float]]:
    """Each step's metrics from `steps.jsonl`; a replayed step's later line wins."""
    history: dict[int, dict[str, float]] = {}
    if steps_file.is_file():
        for line in steps_file.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                history[int(row["step"])] = row
    return dict(sorted(history.items()))


def loss_curve_png(steps_file: Path, evals: list[tuple[int, float]], out: Path) -> Path:
    """Plot the training loss per step (and held-out losses, if any) into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = step_history(steps_file)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(history), [row["loss"] for row in history.values()], lw=1, label="train loss")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out
