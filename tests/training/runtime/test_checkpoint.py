"""The RNG file of a checkpoint: what it holds, and that it is the same bits for the same run."""

import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from training.runtime import checkpoint as ckpt


def _bytes(state: dict[str, object]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_a_draw_from_pythons_random_elsewhere_in_the_process_leaves_the_rng_file_unchanged() -> (
    None
):
    ckpt.seed_rngs(7)
    before = _bytes(ckpt.rng_state())
    random.random()  # another library in the driver's process (a client's retry jitter)
    assert _bytes(ckpt.rng_state()) == before
    torch.rand(1)  # dropout's draws are the run's own: they are saved
    assert _bytes(ckpt.rng_state()) != before


def test_the_rng_file_round_trips_and_an_older_file_with_pythons_state_still_loads(
    tmp_path: Path,
) -> None:
    ckpt.seed_rngs(3)
    path = tmp_path / "rng.pt"
    torch.save(ckpt.rng_state(), path)
    expected = (torch.rand(4), np.random.rand(4))
    ckpt.set_rng_state(ckpt.load_rng_state(path))
    assert torch.equal(torch.rand(4), expected[0])
    assert np.array_equal(np.random.rand(4), expected[1])
    older = ckpt.load_rng_state(path) | {"python": random.getstate()}
    draw = random.random()
    ckpt.set_rng_state(older)
    assert random.random() == draw


def test_a_checkpoint_that_is_not_there_is_named_with_the_ones_that_are(tmp_path: Path) -> None:
    for step in (350, 700):
        (tmp_path / f"checkpoint_step-{step:09d}").mkdir()
    missing = tmp_path / "checkpoint_step-000000060"
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.validate(missing)
    assert str(raised.value) == (
        f"{missing}: no such checkpoint; the checkpoints in {tmp_path}: "
        "checkpoint_step-000000700, checkpoint_step-000000350"
    )
