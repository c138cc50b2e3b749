"""The DeepSpeed engine on CPU starts without JIT-compiling the inference-only shm op."""

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

# A fresh process: a one-rank gloo world, then the engine the loops use. The extension cache
# is empty, so a build of the op would leave its directory there (and take a minute).
ENGINE_IN_FRESH_PROCESS = """
import sys
import torch
import torch.distributed as dist
from training.pretrain.config import TrainConfig
from training.runtime.deepspeed import deepspeed_config
from training.runtime.engine import initialize_deepspeed

dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
train = {"model": {"family": "bert", "size": "tiny"}, "global_batch_size": 2, "zero_stage": 2}
config = deepspeed_config(TrainConfig.model_validate(train), world_size=1)
engine = initialize_deepspeed(model, [{"params": list(model.parameters())}], config)
import deepspeed.comm.comm as cdb_module
print("shm op:", cdb_module.cdb.shm_comm_op)
dist.destroy_process_group()
"""


def test_deepspeed_on_cpu_builds_no_shm_op(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
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
        [sys.executable, "-c", ENGINE_IN_FRESH_PROCESS],
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
    assert "shm op: None" in out
    assert "deepspeed_shm_comm" not in out
    assert not (extensions / "deepspeed_shm_comm").exists()
