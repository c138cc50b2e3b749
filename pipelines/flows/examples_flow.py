"""The `examples` flow: the stages up to encoding (reused when done) → pretraining examples.

Every stage is a task of this one flow run (`run_data_steps`).
"""

from __future__ import annotations

import sys

from pipelines.config import RunConfig, load_config
from pipelines.flows.recipe_flow import recipe_flow
from pipelines.flows.steps import Stages, run_data_steps
from pipelines.ops.runtime import resolve_environment


@recipe_flow(name="examples")
def examples_flow(cfg: RunConfig) -> Stages:
    """Run the upstream stages, then cut the examples; returns each stage's summary."""
    cfg = resolve_environment(cfg)
    return run_data_steps(cfg, "examples")


if __name__ == "__main__":
    examples_flow(load_config(sys.argv[1], sys.argv[2:]))
