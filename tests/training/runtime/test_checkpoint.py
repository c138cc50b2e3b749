"""The RNG file of a checkpoint: what it holds, and that it is the same bits for the same run."""

import io
import random
from pathlib import Path

import numpy as np
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
