"""Unit tests of the loop's parts: checkpoint protocol, data order, guards, DeepSpeed config."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from training.pretrain.config import TrainConfig, deepspeed_config
from training.pretrain.data import (
    Cursor,
    DataError,
    GlobalOrder,
    rank_micro_batches,
    read_manifest,
    sequence_length,
)
from training.runtime import checkpoint as ckpt
from training.runtime.config import GuardConfig
from training.runtime.deepspeed import param_groups
from training.runtime.guard import LossGuard, TrainingDivergedError
from training.runtime.precision import assume_no_native_bf16, cpu_has_native_bf16


def make_checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    path = run_dir / ckpt.checkpoint_name(step)
    (path / "ds").mkdir(parents=True)
    (path / "ds" / "mp_rank_00_model_states.pt").write_bytes(b"weights" * step)
    (path / "rng-rank00000.pt").write_bytes(b"rng")
    if complete:
        ckpt.write_meta(path, {"step": step, "config_hash": "abc"})
    return path


def test_validate_accepts_a_complete_checkpoint(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 3)
    assert ckpt.validate(path, "abc")["step"] == 3


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "ds" / "mp_rank_00_model_states.pt").write_bytes(b"flipped"), "sha256"),
        (lambda p: (p / "rng-rank00000.pt").unlink(), "missing"),
        (lambda p: (p / "stray.pt").write_bytes(b"x"), "not in meta.json"),
        (lambda p: (p / "meta.json").unlink(), "no meta.json"),
        (lambda p: (p / "meta.json").write_text("{trunc"), "unreadable"),
        (
            lambda p: (p / "meta.json").write_text(
                (p / "meta.json").read_text().replace('"step": 3', '"step": 4')
            ),
            "its own sha256",
        ),
    ],
)
def test_validate_refuses_a_damaged_checkpoint(tmp_path: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    path = make_checkpoint(tmp_path, 3)
    damage(path)
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.validate(path)


def test_validate_accepts_a_checkpoint_written_before_meta_carried_its_own_hash(
    tmp_path: Path,
) -> None:
    path = make_checkpoint(tmp_path, 3)
    meta = json.loads((path / "meta.json").read_text())
    del meta[ckpt.SELF_HASH]
    (path / "meta.json").write_text(json.dumps(meta | {"format": 1}))
    assert ckpt.validate(path, "abc")["step"] == 3


def test_validate_refuses_another_configuration(tmp_path: Path) -> None:
    with pytest.raises(ckpt.CheckpointError, match="another configuration"):
        ckpt.validate(make_checkpoint(tmp_path, 3), "other")


def test_resume_prefers_a_newer_valid_orphan_over_rays_checkpoint(tmp_path: Path) -> None:
    reported = make_checkpoint(tmp_path, 3)
    orphan = make_checkpoint(tmp_path, 6)  # complete but never registered by Ray
    found = ckpt.find_resumable(tmp_path, reported, "abc")
    assert found is not None
    assert found.path == orphan


def test_resume_falls_back_when_rays_checkpoint_is_corrupt(tmp_path: Path) -> None:
    older = make_checkpoint(tmp_path, 3)
    reported = make_checkpoint(tmp_path, 6)
    (reported / "rng-rank00000.pt").write_bytes(b"corrupt")
    make_checkpoint(tmp_path, 9, complete=False)  # a save cut off before meta.json
    found = ckpt.find_resumable(tmp_path, reported, "abc")
    assert found is not None
    assert found.path == older


def test_incomplete_checkpoints_are_removed_and_old_ones_pruned(tmp_path: Path) -> None:
    for step in (3, 6, 9):
        make_checkpoint(tmp_path, step)
    partial = make_checkpoint(tmp_path, 12, complete=False)
    assert ckpt.remove_incomplete(tmp_path, None) == [partial]
    ckpt.prune(tmp_path, keep_last=2)
    assert [s for s, _ in ckpt.checkpoint_dirs(tmp_path)] == [9, 6]


@pytest.mark.parametrize(
    ("precision", "loss", "ok"),
    [("fp32", 5.0004, True), ("fp32", 5.01, False), ("bf16", 5.2, True), ("bf16", 5.5, False)],
)
def test_a_resharded_load_must_reproduce_the_saved_reference_loss(
    precision: str, loss: float, ok: bool
) -> None:
    meta = {
        "world_size": 2,
        "train": {"precision": precision, "zero_stage": 3},
        "reference": {"indices": [0, 1], "loss": 5.0},
    }
    if ok:
        ckpt.check_resharded(Path("run/checkpoint_step-000000007"), meta, loss, 1)
        return
    with pytest.raises(ckpt.CheckpointError, match=r"from 2 to 1 workers.*num_workers=2") as err:
        ckpt.check_resharded(Path("run/checkpoint_step-000000007"), meta, loss, 1)
    assert f"reference loss {loss!r}, not the saved 5.0" in str(err.value)


def test_a_checkpoint_without_a_reference_loss_is_not_checked() -> None:
    path = Path("run/checkpoint_step-000000007")
    meta = {"world_size": 2, "train": {"precision": "fp32", "zero_stage": 2}}
    ckpt.check_resharded(path, meta, 1.0, 1)
    assert meta == {"world_size": 2, "train": {"precision": "fp32", "zero_stage": 2}}
    # The same loss is refused once the checkpoint carries a reference: the pass above comes
    # from the missing reference, not from a lax tolerance.
    with pytest.raises(ckpt.CheckpointError, match=r"reference loss 1\.0, not the saved 5\.0"):
        ckpt.check_resharded(path, meta | {"reference": {"indices": [0], "loss": 5.0}}, 1.0, 1)


def test_global_order_is_a_permutation_per_epoch_that_drops_the_tail() -> None:
    order = GlobalOrder(size=10, seed=7, global_batch=4)
    cursor, seen = Cursor(), []
    for _ in range(4):
        epoch, ids, cursor = order.next_batch(cursor)
        seen.append((epoch, ids.tolist()))
    assert [e for e, _ in seen] == [0, 0, 1, 1]
    first_epoch = seen[0][1] + seen[1][1]
    assert len(set(first_epoch)) == 8
    assert not np.array_equal(order.permutation(0), order.permutation(1))
    assert cursor.samples == 16


def test_cursor_continues_identically_after_a_restart() -> None:
    a = GlobalOrder(size=50, seed=1, global_batch=8)
    cursor = Cursor()
    for _ in range(3):
        _, _, cursor = a.next_batch(cursor)
    b = GlobalOrder(size=50, seed=1, global_batch=8)  # a new process
    assert np.array_equal(a.next_batch(cursor)[1], b.next_batch(Cursor(**vars(cursor)))[1])


def test_ranks_split_a_global_batch_without_overlap() -> None:
    ids = np.arange(16)
    parts = [rank_micro_batches(ids, r, 2, 4) for r in range(2)]
    flat = np.concatenate([m for p in parts for m in p])
    assert sorted(flat.tolist()) == list(range(16))
    assert [len(p) for p in parts] == [2, 2]


def test_a_split_smaller_than_a_global_batch_is_refused() -> None:
    with pytest.raises(DataError, match="global_batch_size"):
        GlobalOrder(size=3, seed=0, global_batch=8)


def test_guard_stops_on_a_nonfinite_loss_by_default() -> None:
    guard = LossGuard(GuardConfig())
    with pytest.raises(TrainingDivergedError, match="non-finite loss at step 5"):
        guard.check(torch.tensor(math.nan), 4)


def test_guard_skips_spikes_and_stops_after_too_many() -> None:
    guard = LossGuard(GuardConfig(spike_factor=3.0, on_spike="skip", max_skips=1))
    for step in range(6):
        assert guard.check(torch.tensor(2.0), step) == "ok"
        guard.step_done(False)
    assert guard.check(torch.tensor(7.0), 6) == "skip"
    guard.step_done(True)
    with pytest.raises(TrainingDivergedError, match="in a row"):
        guard.check(torch.tensor(9.0), 7)
    restored = LossGuard(GuardConfig(spike_factor=3.0, max_skips=1))
    restored.load_state(guard.state())
    assert restored.state() == guard.state()


def test_deepspeed_config_follows_the_typed_config() -> None:
    cfg = TrainConfig.model_validate(
        {
            "global_batch_size": 32,
            "micro_batch_size": 4,
            "zero_stage": 3,
            "precision": "bf16",
            "optim": {"decay": "cosine", "warmup_steps": 5},
            "deepspeed_extra": {"zero_optimization": {"reduce_bucket_size": 1000}},
        }
    )
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"] == {
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": False,
        "reduce_bucket_size": 1000,
    }
    assert ds["bf16"]["enabled"]
    assert "scheduler" not in ds  # the loop's GroupLRSchedule sets the rates
    with pytest.raises(ValueError, match="multiple of"):
        deepspeed_config(cfg, world_size=3)


def test_report_poll_is_what_ray_train_passes_to_its_controller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    from training.runtime.config import ScaleConfig
    from training.runtime.launcher import POLL_ENV, set_report_poll

    monkeypatch.setenv(POLL_ENV, "2")  # records the variable's state, restored after the test
    monkeypatch.delenv(POLL_ENV)
    assert POLL_ENV not in get_env_vars_to_propagate()  # Ray's own 2 s default
    set_report_poll(ScaleConfig(report_poll_s=0.25))
    assert get_env_vars_to_propagate()[POLL_ENV] == "0.25"
    set_report_poll(ScaleConfig())  # the default; each run sets its own
    assert float(get_env_vars_to_propagate()[POLL_ENV]) == ScaleConfig().report_poll_s
    with pytest.raises(ValueError, match="report_poll_s"):
        ScaleConfig(report_poll_s=0)


def test_a_gpu_group_carries_gloo_for_the_loops_cpu_reductions() -> None:
    from training.runtime.worker_context import GPU_BACKEND, torch_backend

    assert GPU_BACKEND == "cpu:gloo,cuda:nccl"
    assert torch_backend(None, use_gpu=False) == "gloo"
    assert torch_backend(None, use_gpu=True) == GPU_BACKEND
    assert torch_backend("nccl", use_gpu=True) == GPU_BACKEND  # never NCCL alone
    assert torch_backend("gloo", use_gpu=True) == "gloo"


def test_fp16_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        TrainConfig(precision="fp16")


def test_auto_precision_is_bf16_where_the_hardware_multiplies_bf16() -> None:
    if assume_no_native_bf16():
        pytest.skip("LMPIPE_ASSUME_NO_NATIVE_BF16 is set: detection ignores the CPU's flags")
    native = cpu_has_native_bf16()
    # The CPU's own flags, read apart from torch: the two must agree.
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
        assert native == bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})
    assert TrainConfig().precision == ("bf16" if native else "fp32")
    assert TrainConfig.model_validate({"precision": "auto"}).precision == TrainConfig().precision
    gpu = TrainConfig.model_validate({"scale": {"use_gpu": True}})
    assert gpu.precision == "bf16"
    assert TrainConfig(precision="fp32").precision == "fp32"  # an explicit choice is kept
    assert TrainConfig().model_dump()["precision"] != "auto"  # the record is concrete


def test_default_micro_batch_is_the_ranks_whole_share() -> None:
    cfg = TrainConfig(global_batch_size=32)
    assert cfg.micro_batch_size is None
    for world, micro in ((1, 32), (2, 16), (4, 8)):
        assert cfg.micro_batch(world) == micro
        assert cfg.accumulation_steps(world) == 1
        ds = deepspeed_config(cfg, world)
        assert ds["train_micro_batch_size_per_gpu"] == micro
        assert ds["gradient_accumulation_steps"] == 1
    with pytest.raises(ValueError, match="multiple of the workers \\(3\\)"):
        cfg.micro_batch(3)
    explicit = TrainConfig(global_batch_size=32, micro_batch_size=4)
    assert (explicit.micro_batch(2), explicit.accumulation_steps(2)) == (4, 4)
    with pytest.raises(ValueError, match="micro_batch_size \\(4\\) x workers \\(3\\)"):
        explicit.accumulation_steps(3)


def test_no_weight_decay_on_biases_and_norms() -> None:
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(
        [(f"{i}.{n}", p) for i, m in enumerate(layer) for n, p in m.named_parameters()], 0.1
    )
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3
    assert no_decay["weight_decay"] == 0.0


def test_zero0_runs_bf16_as_autocast_and_leaves_clipping_to_the_loop() -> None:
    bf16 = deepspeed_config(TrainConfig(precision="bf16", zero_stage=0), world_size=1)
    assert bf16["bf16"] == {"enabled": False}
    assert bf16["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert bf16["gradient_clipping"] == 0.0  # the loop clips; its norm stays on the device
    fp16 = deepspeed_config(
        TrainConfig(precision="fp16", zero_stage=0, scale={"use_gpu": True}), world_size=1
    )
    assert fp16["gradient_clipping"] == TrainConfig().optim.grad_clip  # DeepSpeed unscales first
    zero2 = deepspeed_config(TrainConfig(precision="bf16", zero_stage=2), world_size=1)
    assert zero2["bf16"] == {"enabled": True}
    assert "torch_autocast" not in zero2


def test_sequence_length_is_the_manifests_key_and_older_manifests_fall_back(
    demo_data: Any,
) -> None:
    for objective, name in (("causal", "block_size"), ("bert", "max_seq_length")):
        manifest = read_manifest(demo_data.examples(objective)["examples"])
        assert manifest["sequence_length"] == manifest["config"][name] == 64
        older = {k: v for k, v in manifest.items() if k != "sequence_length"}
        older["config"] = {**manifest["config"], name: 48}  # the key an older manifest read
        assert sequence_length(older) == 48
        assert sequence_length(manifest) == 64


def _write_examples(root: Path, chunks: list[int], width: int = 4) -> np.ndarray:
    """An examples directory whose train split is `chunks` record batches over two shards;
    returns every row's ids in order (row i holds i * width, ..., i * width + width - 1)."""
    import pyarrow as pa

    ids = np.arange(sum(chunks) * width, dtype=np.int32).reshape(-1, width)
    shards, start = [], 0
    half = len(chunks) // 2 or 1
    for shard, sizes in enumerate((chunks[:half], chunks[half:])):
        if not sizes:
            continue
        batches = []
        for size in sizes:
            block = ids[start : start + size]
            column = pa.FixedSizeListArray.from_arrays(pa.array(block.ravel()), width)
            lengths = pa.array(np.full(size, width, dtype=np.int32))
            starts = pa.array([[0, int(row[0]) % width] for row in block], pa.list_(pa.int32()))
            names = ["input_ids", "length", "doc_starts"]
            batches.append(pa.record_batch([column, lengths, starts], names=names))
            start += size
        name = f"train-{shard}.arrow"
        path = str(root / name)
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, batches[0].schema) as out:
            for batch in batches:
                out.write_batch(batch)
        shards.append({"name": name, "sha256": "-", "rows": sum(sizes)})
    manifest = {"stage": "examples", "objective": "causal", "splits": {"train": {"shards": shards}}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return ids


@pytest.mark.parametrize("whole", [True, False], ids=["held whole", "memory-mapped only"])
@pytest.mark.parametrize("chunks", [[10], [3, 4, 3]], ids=["one chunk", "three chunks"])
def test_take_returns_the_rows_at_global_indices_in_their_order(
    tmp_path: Path, chunks: list[int], whole: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.pretrain import data as data_module
    from training.pretrain.data import ExampleShards

    ids = _write_examples(tmp_path, chunks)
    if not whole:  # a split over the size a split is held whole at
        monkeypatch.setattr(data_module, "WHOLE_BYTES", 0)
    data = ExampleShards(tmp_path, "train", verify=False)
    assert (data.whole is not None) is (whole and len(chunks) > 1)
    wanted = np.array([9, 0, 4, 3, 4, 7])
    rows = data.take(wanted)
    np.testing.assert_array_equal(rows["input_ids"], ids[wanted])
    np.testing.assert_array_equal(rows["length"], np.full(len(wanted), ids.shape[1]))
    assert rows["doc_starts"] == [[0, int(ids[i, 0]) % ids.shape[1]] for i in wanted]
    lean = data.take(wanted, doc_starts=False)  # for a builder that does not read them
    assert sorted(lean) == ["input_ids", "length"]
    np.testing.assert_array_equal(lean["input_ids"], rows["input_ids"])


def test_without_a_spike_check_the_device_decision_still_skips_a_nonfinite_loss() -> None:
    guard = LossGuard(GuardConfig(on_nonfinite="skip", max_skips=3))  # spike_factor None
    flags = []
    for step, loss in enumerate([2.0, float("nan"), 1.5]):
        guard.observe(torch.tensor(loss))
        skip, record = guard.decide()
        flags.append(float(skip))
        assert guard.replay(step, record.tolist()) is (flags[-1] == 1.0)
        # No running mean kept, never armed: on one rank the record is the step's loss alone
        np.testing.assert_array_equal(record.numpy(), [loss])
    assert flags == [0.0, 1.0, 0.0]
    assert (guard.skipped_total, list(guard.history)) == (1, [2.0, 1.5])
