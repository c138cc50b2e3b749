"""On one CUDA GPU, in bf16: every family's training step, the loop's exact resume, the export.

Marked `gpu`: `make test` deselects them (`-m 'not gpu'`), `make test-gpu` runs them. Where
`torch.cuda.is_available()` is false they skip with that reason, or fail when
`LMPIPE_REQUIRE_GPU=1` (`make test-gpu` and the offline command set it), so a machine without a
usable GPU never reports them as passed.

The module imports the training stack only (torch, transformers, DeepSpeed, pydantic, pyarrow):
no Ray, Prefect or MLflow, so it also runs on a GPU image that lacks them, with the demo BERT
examples carried in `LMPIPE_GPU_TEST_DATA` (`gpu_data.py`; docs/testing.md, "GPU tests").
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from local_runs import MAX_STEPS, STOP_AT, bf16_resume_config, train_locally, whole_and_resumed

from tasks.common import schema
from training.models.export import DataRef, ModelCard, TokenizerRef, export_model, load_export
from training.models.models import OBJECTIVES, Family
from training.models.vocab import unpad_vocab
from training.pretrain.config import TrainConfig, deepspeed_config
from training.pretrain.data import EVAL_EPOCH
from training.pretrain.losses import exported_model, pretraining_loss
from training.pretrain.losses.common import ATTENTION_MASK
from training.pretrain.pretraining_model import build_pretraining_model
from training.runtime.deepspeed import param_groups
from training.runtime.engine import autocast_for

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REQUIRE_GPU_ENV = "LMPIPE_REQUIRE_GPU"
DATA_ENV = "LMPIPE_GPU_TEST_DATA"  # a folder with bert/examples and bert/tokenizer
# cuBLAS is deterministic on one stream only with a fixed workspace; torch refuses its matmuls
# under `use_deterministic_algorithms` without this. Read when cuBLAS first starts: set at import.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

VOCAB, B, T = 512, 2, 24
SPECIALS: dict[str, int | None] = {
    "cls": 2,
    "sep": 3,
    "pad": 0,
    "mask": 4,
    "eos": 3,
    "sentinel_top": VOCAB - 1,
    "vocab_size": VOCAB,
}


@pytest.fixture(scope="module", autouse=True)
def cuda() -> torch.device:
    """The GPU; skip (or fail under `LMPIPE_REQUIRE_GPU=1`) before any other set-up without one."""
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU: torch.cuda.is_available() is false"
        if os.environ.get(REQUIRE_GPU_ENV, "0") not in ("", "0"):
            pytest.fail(f"{reason}, and {REQUIRE_GPU_ENV} is set")
        pytest.skip(reason)
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def bert_examples(request: pytest.FixtureRequest) -> dict[str, Path]:
    """The demo corpus's BERT examples: carried (`LMPIPE_GPU_TEST_DATA`) or built here on Ray."""
    carried = os.environ.get(DATA_ENV)
    if carried:
        data = {part: Path(carried) / "bert" / part for part in ("examples", "tokenizer")}
        missing = [str(path) for path in data.values() if not path.is_dir()]
        assert not missing, f"{DATA_ENV}={carried} lacks {missing} (run gpu_data.py)"
        return data
    demo: Any = request.getfixturevalue("demo_data")  # needs Ray: the full dev install
    built: dict[str, Path] = demo.examples("bert")
    return built


@pytest.fixture(scope="module")
def gpu_process_group(cuda: torch.device) -> Iterator[None]:
    """One rank over `cpu:gloo,cuda:nccl`, as the loop runs without Ray (`init_single_process`)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    from training.runtime.worker_context import init_single_process

    with pytest.MonkeyPatch.context() as mp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
        sock.close()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "LOCAL_RANK": "0"}
        for key, value in (env | {"WORLD_SIZE": "1"}).items():
            mp.setenv(key, value)
        assert not dist.is_initialized(), "another module left a process group"
        groups._WORLD_GROUP = None  # DeepSpeed caches a clone of the world group
        init_single_process()
        yield
        dist.destroy_process_group()
        groups._WORLD_GROUP = None


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Deterministic CUDA kernels (no atomics in the backward): bit-exact comparisons need it."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def batch_for(objective: str, device: torch.device) -> dict[str, torch.Tensor]:
    """A seeded random batch of the objective's columns; the second row ends in padding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB - 8, (B, T), generator=gen)
    real = torch.ones(B, T, dtype=torch.long)
    real[1, T - 6 :] = 0
    ids = ids.masked_fill(real == 0, 0)
    batch = {schema.INPUT_IDS: ids, ATTENTION_MASK: real}
    if objective in ("span_corruption", "denoising"):
        target = torch.randint(5, VOCAB - 8, (B, T // 2), generator=gen)
        start = SPECIALS["eos"] if objective == "denoising" else SPECIALS["pad"]
        batch[schema.LABELS] = target
        batch[schema.DECODER_INPUT_IDS] = torch.cat([torch.full((B, 1), start), target[:, :-1]], 1)
    elif objective != "causal":  # masked LM: every 5th real token
        chosen = (torch.arange(T) % 5 == 1)[None, :] & (real == 1)  # (B, T)
        batch[schema.INPUT_IDS] = ids.masked_fill(chosen, SPECIALS["mask"])
        batch[schema.LABELS] = torch.where(chosen, ids, -100)
        if objective in ("bert", "sop"):
            batch[schema.TOKEN_TYPE_IDS] = (torch.arange(T)[None, :] >= T // 2).long().expand(B, T)
            key = schema.NEXT_SENTENCE_LABEL if objective == "bert" else schema.SENTENCE_ORDER_LABEL
            batch[key] = torch.tensor([0, 1])
    return {name: tensor.to(device) for name, tensor in batch.items()}


@pytest.mark.parametrize("family", get_args(Family))
def test_family_takes_a_bf16_training_step_on_the_gpu(family: Family, cuda: torch.device) -> None:
    objective = OBJECTIVES[family][0]
    cfg = TrainConfig.model_validate(
        {
            "model": {"family": family, "size": "tiny"},
            "precision": "bf16",
            "zero_stage": 0,
            "scale": {"num_workers": 1, "use_gpu": True},
        }
    )
    torch.manual_seed(0)
    model = build_pretraining_model(cfg, objective, VOCAB, SPECIALS, T).to(cuda)
    # The loop's optimizer at ZeRO 0: torch's fused AdamW over lmpipe's two groups.
    groups = param_groups(model.named_parameters(), cfg.optim.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, fused=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    dtypes: set[torch.dtype] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _args, out: dtypes.add(out.dtype))
    with autocast_for(deepspeed_config(cfg, 1), cuda):  # the loop's bf16 at ZeRO 0
        out = pretraining_loss(model, objective, batch_for(objective, cuda))
    out.loss.backward()
    optimizer.step()
    assert torch.bfloat16 in dtypes, dtypes
    assert bool(torch.isfinite(out.loss)), float(out.loss)
    named = dict(model.named_parameters())
    trained = {n for n, p in named.items() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert len(trained) >= 0.8 * len(named), sorted(set(named) - trained)
    assert all(bool(torch.isfinite(named[n].grad).all()) for n in trained)
    unchanged = {n for n in trained if torch.equal(named[n].detach(), before[n])}
    assert not unchanged, sorted(unchanged)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_bf16_run_stopped_and_resumed_on_one_gpu_matches_the_uninterrupted_run(
    zero_stage: int,
    bert_examples: dict[str, Path],
    gpu_process_group: None,
    deterministic: None,
    tmp_path: Path,
) -> None:
    # ZeRO 0: torch autocast over fp32 weights; ZeRO 2: DeepSpeed's bf16 weights with fp32
    # master copies in the optimizer partitions. Both must come back bit for bit.
    cfg = bf16_resume_config(use_gpu=True, zero_stage=zero_stage)
    whole, resumed = whole_and_resumed(cfg, bert_examples, tmp_path)
    assert resumed.worker.engine.device.type == "cuda"
    after = range(STOP_AT + 1, MAX_STEPS + 1)
    assert [resumed.losses()[s] for s in after] == [whole.losses()[s] for s in after]
    a, b = whole.weights(), resumed.weights()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_gpu_trained_export_reloads_with_identical_logits(
    bert_examples: dict[str, Path], gpu_process_group: None, cuda: torch.device, tmp_path: Path
) -> None:
    run = train_locally(bf16_resume_config(use_gpu=True, zero_stage=0), bert_examples, tmp_path)
    trained = exported_model(run.worker.engine.module).eval()
    unpad_vocab(trained)  # as the stage's export: the tokenizer's rows only
    card = ModelCard(
        family="bert",
        size="tiny",
        parameters=trained.num_parameters(),
        objective="bert",
        steps=run.worker.step,
        tokens_seen=run.worker.tokens_seen,
        data=DataRef(path=str(bert_examples["examples"] / "manifest.json"), fingerprint="demo"),
        tokenizer=TokenizerRef(
            fingerprint="demo", family="wordpiece", vocab_size=trained.config.vocab_size
        ),
        deepspeed={"zero_stage": 0, "precision": "bf16"},
        git_commit="test",
    )
    hf_dir = export_model(trained, bert_examples["tokenizer"], tmp_path / "export", card)
    reloaded, _ = load_export(hf_dir, "bert")  # from_pretrained, safetensors, offline
    reloaded = reloaded.to(cuda).eval()
    ids = torch.arange(8).numpy()
    rows = run.worker.build(run.worker.eval_data.take(ids), ids, EVAL_EPOCH)
    names = (schema.INPUT_IDS, ATTENTION_MASK, schema.TOKEN_TYPE_IDS)
    inputs = {name: rows[name].to(cuda) for name in names if name in rows}
    with torch.no_grad():
        expected = trained(**inputs).prediction_logits  # (B, T, V) fp32
        got = reloaded(**inputs).prediction_logits
    assert expected.device.type == got.device.type == "cuda"
    assert torch.equal(got, expected)
