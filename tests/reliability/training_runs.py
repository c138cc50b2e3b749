"""Tiny BERT pretraining runs on the session's Ray, for the reliability modules.

Real Ray Train (2 workers) and real DeepSpeed (ZeRO-2, fp32, CPU) on the demo corpus's BERT
examples; each module sets the steps, checkpoint cadence and failure budget it needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.common.ray_runtime import RayConfig
from training.pretrain.config import TrainConfig
from training.pretrain.driver import RunControl, TrainingRun, run_training
from training.runtime.run_context import RunContext
from training.tracking.runs import TrackingConfig


def tiny_bert_config(
    storage: Path, *, max_steps: int, every: int, keep_last: int, max_failures: int, **extra: Any
) -> TrainConfig:
    """A tiny BERT run of `max_steps`, a checkpoint every `every` steps under `storage`."""
    return TrainConfig.model_validate(
        {
            "model": {"family": "bert", "size": "tiny"},
            "max_steps": max_steps,
            "global_batch_size": 32,
            "micro_batch_size": 16,
            "zero_stage": 2,
            "precision": "fp32",  # the bit-identical checks (the default is bf16 here)
            "checkpoint": {
                "every_steps": every,
                "keep_last": keep_last,
                "storage_path": str(storage),
            },
            "eval": {"every_steps": max_steps, "max_samples": 16},
            "scale": {"num_workers": 2, "max_failures": max_failures},
            **extra,
        }
    )


def train(cfg: TrainConfig, data: dict[str, Path], **kw: Any) -> TrainingRun:
    """Run `cfg` on `data` (`examples`, `tokenizer`) without MLflow; `kw` are `RunControl`'s."""
    storage = cfg.checkpoint.storage_path
    assert storage is not None, "the reliability runs keep their checkpoints under tmp_path"
    ray_cfg, off = RayConfig(num_workers=2, num_cpus=4), TrackingConfig(enabled=False)
    ctx = RunContext(storage / "ws", seed=0, ray=ray_cfg, tracking=off, name="reliability")
    control = RunControl(**kw)
    return run_training(
        cfg, data["examples"], data["tokenizer"], run=ctx, mlflow_run_id=None, control=control
    )
