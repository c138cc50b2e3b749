"""A training worker's start: what its entry modules import, and the DeepSpeed engine on CPU.

One fresh process, as a Ray Train worker starts: it imports both loops' entry modules, then
initialises the engine the loops use. Neither pulls in what a step does not need (MLflow, other
model families, the data and plotting libraries), and DeepSpeed starts without JIT-compiling
the inference-only shm op.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]

#: Not imported by a worker's entry modules (`training.pretrain.loop`, `training.finetune.loop`):
#: each costs 0.1-3 s of every worker start and no step needs it (MLflow is rank 0's tracker's,
#: imported when it is made; a family's modeling module when that family is built).
NOT_AT_ENTRY = (
    "mlflow",
    "deepspeed",
    "matplotlib",
    "sklearn",
    "pandas",
    "datasets",
    "prefect",
    "rich",
    "peft",
    "ray",
    "transformers.models.bert.modeling_bert",
    "transformers.models.big_bird.modeling_big_bird",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.t5.modeling_t5",
)

# A fresh process: the loops' entry modules, a one-rank gloo world, then the engine the loops
# use. The extension cache is empty, so a build of the op would leave its directory there (and
# take a minute).
WORKER_IN_FRESH_PROCESS = f"""
import sys
import training.pretrain.loop, training.finetune.loop
print("at entry:", sorted(m for m in {NOT_AT_ENTRY!r} if m in sys.modules))
import torch
import torch.distributed as dist
from training.pretrain.config import TrainConfig, deepspeed_config
from training.runtime.engine import initialize_deepspeed

dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
train = {{"model": {{"family": "bert", "size": "tiny"}}, "global_batch_size": 2, "zero_stage": 2}}
config = deepspeed_config(TrainConfig.model_validate(train), world_size=1)
engine = initialize_deepspeed(model, [{{"params": list(model.parameters())}}], config)
print("mlflow after the engine:", "mlflow" in sys.modules)
import deepspeed.comm.comm as cdb_module
print("shm op:", cdb_module.cdb.shm_comm_op)
print("forward hooks:", len(model._forward_pre_hooks) + len(model._forward_hooks))
timed = torch.nn.Linear(4, 2)
config = config | {{"wall_clock_breakdown": True}}  # a feature the hooks serve
initialize_deepspeed(timed, [{{"params": list(timed.parameters())}}], config)
print("forward hooks with the timers:", len(timed._forward_pre_hooks) + len(timed._forward_hooks))
dist.destroy_process_group()
import mlflow  # still importable: rank 0's tracker imports it when it is made
print("mlflow then:", mlflow.__name__)
"""


@pytest.fixture(scope="module")
def fresh_worker(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Run `WORKER_IN_FRESH_PROCESS` once; its output and its (empty) extension cache."""
    extensions = tmp_path_factory.mktemp("worker") / "torch_extensions"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = os.environ | {
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "PYTHONPATH": str(REPO),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", WORKER_IN_FRESH_PROCESS],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a compiler it might start is in its group, killed with it
    )
    try:
        out, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the group this test started, and only it
        out, _ = process.communicate()
    assert process.returncode == 0, out[-3000:]
    return out, extensions


def test_a_workers_entry_modules_import_nothing_a_step_does_not_need(
    fresh_worker: tuple[str, Path],
) -> None:
    out, _ = fresh_worker
    assert "at entry: []" in out


def test_deepspeed_starts_without_mlflow_which_stays_importable(
    fresh_worker: tuple[str, Path],
) -> None:
    out, _ = fresh_worker
    assert "mlflow after the engine: False" in out
    assert "mlflow then: mlflow" in out


def test_deepspeed_on_cpu_builds_no_shm_op(fresh_worker: tuple[str, Path]) -> None:
    out, extensions = fresh_worker
    assert "shm op: None" in out
    assert "deepspeed_shm_comm" not in out
    assert not (extensions / "deepspeed_shm_comm").exists()


def test_deepspeeds_forward_hooks_go_where_every_feature_they_serve_is_off(
    fresh_worker: tuple[str, Path],
) -> None:
    out, _ = fresh_worker
    assert "forward hooks: 0" in out  # the loops call the module: its hooks would be no-ops
    assert "forward hooks with the timers: 2" in out  # the prologue and the epilogue stay
