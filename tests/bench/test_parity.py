"""bench/parity.py: the output checks that void a CPU benchmark whose arms disagree."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

PARITY = Path(__file__).resolve().parents[2] / "bench" / "parity.py"


@pytest.fixture(scope="module")
def parity() -> Any:
    spec = importlib.util.spec_from_file_location("bench_parity", PARITY)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_same_ids_count_no_differing_segment(parity: Any, tmp_path: Path) -> None:
    parity.save_ids(tmp_path / "a.npz", [1, 2, 3, 4], [2, 2])
    parity.save_ids(tmp_path / "b.npz", [1, 2, 3, 4], [2, 2])
    assert parity.differing_segments(tmp_path / "a.npz", tmp_path / "b.npz")["differing"] == 0


def test_one_changed_id_or_boundary_counts_its_segments(parity: Any, tmp_path: Path) -> None:
    parity.save_ids(tmp_path / "a.npz", [1, 2, 3, 4, 5], [2, 2, 1])
    parity.save_ids(tmp_path / "b.npz", [1, 2, 3, 9, 5], [2, 2, 1])
    parity.save_ids(tmp_path / "c.npz", [1, 2, 3, 4, 5], [1, 3, 1])
    assert parity.differing_segments(tmp_path / "a.npz", tmp_path / "b.npz")["differing"] == 1
    assert parity.differing_segments(tmp_path / "a.npz", tmp_path / "c.npz")["differing"] == 2


def test_expected_blocks_restart_at_each_run_and_drop_its_tail(parity: Any) -> None:
    lengths = np.array([3, 3, 2], np.int64)  # each with its end-of-text
    stream = np.array([1, 2, 0, 3, 4, 0, 5, 0])
    whole = parity.expected_blocks(lengths, stream, np.array([0]), 2)
    assert whole.tolist() == [[1, 2], [0, 3], [4, 0], [5, 0]]
    cut = parity.expected_blocks(lengths, stream, np.array([0, 1]), 2)
    assert cut.tolist() == [[1, 2], [3, 4], [0, 5]]


def test_blocks_that_differ_void_the_run(parity: Any) -> None:
    blocks = np.arange(8).reshape(4, 2)
    parity.require_equal_blocks("same", blocks, blocks.copy())
    with pytest.raises(SystemExit):
        parity.require_equal_blocks("other", blocks, blocks[::-1])
    assert parity.same_rows(blocks, blocks[::-1])
    assert not parity.same_rows(blocks, blocks + 1)


def test_masking_counts_accept_bert_masking_and_reject_a_masked_special(parity: Any) -> None:
    original = np.array([[101, 7, 8, 9, 102]])
    special = np.array([[True, False, False, False, True]])
    new = np.array([[101, 103, 8, 5, 102]])
    labels = np.array([[-100, 7, -100, 9, -100]])
    counts = parity.masking_counts(original, special, new, labels, 103)
    assert counts == {"chosen": 2, "masked": 1, "randomized": 1, "maskable": 3}
    with pytest.raises(SystemExit):
        parity.masking_counts(original, special, new, np.array([[101, 7, -100, 9, -100]]), 103)
    with pytest.raises(SystemExit):
        parity.require_same_masking({"off": parity.masking_summary([counts])})
