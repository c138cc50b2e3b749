"""The sequence-length schedule: lengths by step, rows cut to them, and the loop following it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from pydantic import ValidationError

from tasks.common import schema
from tasks.common.io import sha256_file, write_ipc_stream
from tasks.examples.examples import fixed
from tasks.examples.objectives.masking import MaskConfig
from tasks.examples.pairs import Pair, pair_rows
from tasks.examples.specials import Specials
from training.pretrain.config import TrainConfig
from training.pretrain.data import BatchBuilder, Cursor, GlobalOrder, Masker
from training.pretrain.length_schedule import (
    AlternateLengths,
    LengthScheduleError,
    StagedLengths,
    check_length_schedule,
    length_at,
    rows_at_length,
)
from training.pretrain.packing import causal_document_mask, document_positions

CLS, PAD, SEP, UNK, MASK = 0, 1, 2, 3, 4  # RoBERTa's order: <s> <pad> </s> <unk> <mask>
SPECIAL_IDS = np.array([CLS, PAD, SEP, UNK, MASK])
VOCAB = 64


def staged(*stages: tuple[int | None, int]) -> StagedLengths:
    return StagedLengths.model_validate(
        {"mode": "staged", "stages": [{"until_step": u, "length": n} for u, n in stages]}
    )


def roberta_rows(lengths: list[int], width: int, seed: int = 0) -> dict[str, Any]:
    """`<s> x </s>` rows padded to `width`; static labels: the token itself at every word."""
    rng = np.random.default_rng(seed)
    ids = np.full((len(lengths), width), PAD, dtype=np.uint16)
    for row, n in enumerate(lengths):
        ids[row, 0], ids[row, n - 1] = CLS, SEP
        ids[row, 1 : n - 1] = rng.integers(5, VOCAB, n - 2)
    labels = np.where(np.isin(ids, SPECIAL_IDS), -100, ids.astype(np.int32))
    return {
        schema.INPUT_IDS: ids,
        schema.LENGTH: np.asarray(lengths, dtype=np.int32),
        schema.LABELS: labels,
    }


def bert_rows(segments: list[tuple[int, int]], width: int) -> dict[str, Any]:
    """`[CLS] A [SEP] B [SEP]` rows from the example stage's `pair_rows`, with static labels."""
    pairs = [
        Pair(
            a=np.arange(10, 10 + a), b=np.arange(40, 40 + b), label=1, doc=0, b_doc=1, single=False
        )
        for a, b in segments
    ]
    sp = Specials(CLS, SEP, PAD, MASK, SEP, None, VOCAB, frozenset(SPECIAL_IDS.tolist()))
    ids, types, lengths, _ = pair_rows(pairs, sp, width)
    return {
        schema.INPUT_IDS: ids,
        schema.TOKEN_TYPE_IDS: types,
        schema.LENGTH: lengths.astype(np.int32),
        schema.NEXT_SENTENCE_LABEL: np.ones(len(pairs), dtype=np.int8),
        schema.LABELS: np.where(np.isin(ids, SPECIAL_IDS), -100, ids).astype(np.int32),
    }


# --- which length each step trains at ---------------------------------------------------------


def test_staged_lengths_switch_exactly_after_each_stages_until_step() -> None:
    schedule = staged((3, 16), (5, 32), (None, 64))
    assert [length_at(schedule, step, 64) for step in range(8)] == [16, 16, 16, 32, 32, 64, 64, 64]


def test_alternate_lengths_put_every_nth_step_at_full_length() -> None:
    schedule = AlternateLengths(mode="alternate", short=16, every=3)
    lengths = [length_at(schedule, step, 64) for step in range(7)]
    assert lengths == [16, 16, 64, 16, 16, 64, 16]  # steps 3 and 6, counted from 1


def test_no_schedule_trains_every_step_at_full_length() -> None:
    assert {length_at(None, step, 128) for step in range(5)} == {128}


def test_a_length_longer_than_the_examples_is_refused() -> None:
    with pytest.raises(LengthScheduleError, match="exceeds the examples' length 64"):
        length_at(staged((2, 16), (None, 128)), 2, 64)
    with pytest.raises(LengthScheduleError, match="length 128 exceeds"):
        check_length_schedule(staged((2, 16), (None, 128)), "roberta", 64)  # before step 2


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "where", "message"),
    [
        ({"mode": "staged", "stages": [{"until_step": 5, "length": 16}]}, "staged",
         r"stages\[0\].until_step=5: the last stage runs to the end"),
        ({"mode": "staged", "stages": [{"length": 16}, {"length": 32}]}, "staged",
         r"stages\[0\].until_step is null: only the last stage is open-ended"),
        ({"mode": "staged", "stages": [{"until_step": 5, "length": 16},
                                       {"until_step": 5, "length": 32}, {"length": 64}]},
         "staged", r"stages\[1\].until_step=5 must be greater than stages\[0\].until_step=5"),
        ({"mode": "staged", "stages": [{"length": 4}]}, "staged.stages.0.length",
         "greater than or equal to 8"),
        ({"mode": "staged", "stages": []}, "staged.stages", "at least 1 item"),
        ({"mode": "alternate", "short": 4, "every": 2}, "alternate.short",
         "greater than or equal to 8"),
        ({"mode": "alternate", "short": 16, "every": 1}, "alternate.every",
         "greater than or equal to 2"),
        ({"mode": "cyclic", "short": 16}, "", "does not match any of the expected tags"),
    ],
)  # fmt: skip
def test_invalid_schedules_are_refused_naming_the_field(
    schedule: dict[str, Any], where: str, message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as err:
        TrainConfig.model_validate({"length_schedule": schedule})
    loc = ".".join(str(p) for p in err.value.errors()[0]["loc"])
    assert loc == f"length_schedule.{where}".rstrip(".")


def test_both_modes_validate_from_yaml_shaped_values() -> None:
    cfg = TrainConfig.model_validate(
        {"length_schedule": {"mode": "staged", "stages": [{"until_step": 9, "length": 128},
                                                          {"until_step": None, "length": 512}]}}
    )  # fmt: skip
    assert isinstance(cfg.length_schedule, StagedLengths)
    alternate = TrainConfig.model_validate({"length_schedule": {"mode": "alternate", "every": 4}})
    assert alternate.length_schedule == AlternateLengths(mode="alternate", short=128, every=4)
    assert TrainConfig().length_schedule is None


@pytest.mark.parametrize("objective", ["span_corruption", "denoising"])
def test_seq2seq_objectives_refuse_a_schedule(objective: str) -> None:
    with pytest.raises(LengthScheduleError, match=r"remove train\.length_schedule"):
        check_length_schedule(staged((2, 16), (None, 64)), objective, 64)
    rows = {schema.INPUT_IDS: np.zeros((2, 64), dtype=np.int64)}
    with pytest.raises(LengthScheduleError, match="no sequence length to cut"):
        rows_at_length(rows, objective, 16)


def test_a_causal_length_that_does_not_divide_the_block_is_refused() -> None:
    schedule = AlternateLengths(mode="alternate", short=24, every=2)
    with pytest.raises(LengthScheduleError, match="does not divide the causal block_size 64"):
        check_length_schedule(schedule, "causal", 64)
    check_length_schedule(schedule, "roberta", 64)  # any length cuts a masked-LM row


# --- masked LM: truncation --------------------------------------------------------------------


def test_truncated_rows_end_with_their_separator_and_keep_lengths_and_labels_consistent() -> None:
    rows = roberta_rows([32, 12, 5], width=32)
    cut = rows_at_length(rows, "roberta", 8)
    ids, labels = cut[schema.INPUT_IDS], cut[schema.LABELS]
    assert ids.shape == labels.shape == (3, 8)
    assert cut[schema.LENGTH].tolist() == [8, 8, 5]
    assert ids[:, 0].tolist() == [CLS] * 3
    assert ids[[0, 1], 7].tolist() == [SEP, SEP]
    assert np.array_equal(ids[:2, :7], rows[schema.INPUT_IDS][:2, :7])
    assert np.array_equal(ids[2], rows[schema.INPUT_IDS][2, :8])  # short enough: only padding cut
    assert labels[:2, 7].tolist() == [-100, -100]  # the label under the separator is dropped
    kept = labels != -100
    assert np.array_equal(labels[kept], ids[kept])  # each label still sits on its token
    batch = BatchBuilder("roberta")(cut, np.arange(3), 0)
    assert batch["attention_mask"].sum(dim=1).tolist() == [8, 8, 5]


def test_pair_rows_keep_both_segments_and_their_token_types() -> None:
    rows = bert_rows([(20, 20), (3, 30), (25, 2), (2, 3)], width=48)
    cut = rows_at_length(rows, "bert", 16)
    ids, types, labels = cut[schema.INPUT_IDS], cut[schema.TOKEN_TYPE_IDS], cut[schema.LABELS]
    kept_a = [7, 3, 11, 2]  # longest first: 13 slots for A + B
    assert cut[schema.LENGTH].tolist() == [16, 16, 16, 8]
    for row, (a, length) in enumerate(zip(kept_a, cut[schema.LENGTH], strict=True)):
        b = length - 3 - a
        assert ids[row, :length].tolist() == [CLS, *range(10, 10 + a), SEP, *range(40, 40 + b), SEP]
        assert types[row, :length].tolist() == [0] * (a + 2) + [1] * (b + 1)
    kept = labels != -100
    assert np.array_equal(labels[kept], ids[kept])
    assert cut[schema.NEXT_SENTENCE_LABEL].tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize(("objective", "rows"), [
    ("roberta", roberta_rows([64, 40, 64, 20, 9, 64], width=64)),
    ("bert", bert_rows([(30, 31), (10, 40), (5, 5), (50, 8), (20, 20), (1, 60)], width=64)),
])  # fmt: skip
def test_dynamic_masking_never_labels_a_position_past_the_cut(
    objective: str, rows: dict[str, Any]
) -> None:
    masker = Masker(
        cfg=MaskConfig(masked_lm_prob=0.5),
        seed=3,
        mask_id=MASK,
        special_ids=SPECIAL_IDS,
        random_ids=np.arange(5, VOCAB),
        word_starts=None,
    )
    rows = {k: v for k, v in rows.items() if k != schema.LABELS}
    build = BatchBuilder(objective, masker)
    batch = build(rows, np.arange(6), 0, length=16)
    labels, mask = batch[schema.LABELS], batch["attention_mask"]
    assert labels.shape == mask.shape == (6, 16)
    assert ((labels != -100) <= (mask == 1)).all()  # only real tokens are predicted
    assert not (labels[:, -1] != -100).any()  # never the closing separator
    assert (labels != -100).sum() > 10  # masking did happen
    ends = mask.sum(dim=1) - 1
    assert batch[schema.INPUT_IDS][torch.arange(6), ends].tolist() == [SEP] * 6


# --- causal: blocks split ---------------------------------------------------------------------


def test_causal_blocks_split_into_shorter_blocks_keep_every_token_in_order() -> None:
    ids = np.arange(2 * 16, dtype=np.uint16).reshape(2, 16)
    rows = {schema.INPUT_IDS: ids, schema.DOC_STARTS: [[5, 9], [8, 13]]}
    cut = rows_at_length(rows, "causal", 4)
    assert cut[schema.DOC_STARTS] == [[], [1], [1], [], [], [], [], [1]]  # 8 starts no boundary
    batch = BatchBuilder("causal", document_masking=True)(rows, np.arange(2), 0, length=4)
    assert batch[schema.INPUT_IDS].flatten().tolist() == ids.flatten().tolist()
    assert batch[schema.INPUT_IDS].shape == (8, 4)
    mask = causal_document_mask(batch["document_ids"], torch.float32)  # built on the device
    assert mask.shape == (8, 1, 4, 4)
    # Positions restart at every piece and document start, as for blocks cut at 4 tokens.
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 3], [0, 0, 1, 2], [0, 0, 1, 2], [0, 1, 2, 3],
        [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 1, 2],
    ]  # fmt: skip
    positions = document_positions(cut[schema.DOC_STARTS], 4)
    assert batch["position_ids"].tolist() == positions.tolist()


def test_full_length_leaves_rows_untouched() -> None:
    rows = roberta_rows([32, 12], width=32)
    assert rows_at_length(rows, "roberta", 32) is rows
    batch = BatchBuilder("roberta")(rows, np.arange(2), 0, length=32)
    assert batch[schema.INPUT_IDS].shape == (2, 32)


# --- through the real loop --------------------------------------------------------------------


def write_examples(root: Path, width: int, rows: int) -> tuple[Path, np.ndarray]:
    """Static-masked roberta examples written as the example stage does; their lengths."""
    root.mkdir(parents=True)
    lengths = np.random.default_rng(1).integers(width // 2, width + 1, rows).tolist()
    splits = {}
    for split in ("train", "validation"):
        data = roberta_rows(lengths, width, seed=len(split))
        table = pa.table(
            {
                schema.INPUT_IDS: fixed(data[schema.INPUT_IDS], pa.uint16()),
                schema.LENGTH: pa.array(data[schema.LENGTH]),
                schema.LABELS: fixed(data[schema.LABELS], pa.int32()),
            },
            schema=schema.examples_schema("roberta", width, pa.uint16(), labels=True),
        )
        path = root / f"{split}-00000.arrow"
        write_ipc_stream(table, path)
        entry = {"name": path.name, "sha256": sha256_file(path), "rows": rows}
        splits[split] = {"shards": [entry]}
    manifest = {
        "stage": "examples",
        "objective": "roberta",
        "config": {"max_seq_length": width, "masking": "static", "mask": {"masked_lm_prob": 0.15}},
        "specials": {"vocab_size": VOCAB, "pad": PAD, "cls": CLS, "sep": SEP, "eos": SEP,
                     "mask": MASK},
        "splits": splits,
    }  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root, np.asarray(lengths)


LOOP_SCHEDULES = [
    ({"mode": "staged", "stages": [{"until_step": 2, "length": 8},
                                   {"until_step": 4, "length": 16}, {"length": 32}]},
     [8, 8, 16, 16, 32, 32]),
    ({"mode": "alternate", "short": 8, "every": 3}, [8, 8, 32, 8, 8, 32]),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "expected_lengths"), LOOP_SCHEDULES)
def test_the_loop_trains_each_step_at_its_scheduled_length(
    schedule: dict[str, Any], expected_lengths: list[int], single_process_dist: None, tmp_path: Path
) -> None:
    from training.pretrain.loop import WorkerJob, run_worker
    from training.runtime.worker_context import LocalContext

    examples, lengths = write_examples(tmp_path / "examples", width=32, rows=16)
    cfg = TrainConfig.model_validate(
        {
            "model": {"family": "roberta", "size": "tiny"},
            "max_steps": 6,
            "global_batch_size": 4,
            "micro_batch_size": 4,
            "zero_stage": 0,
            "length_schedule": schedule,
            "checkpoint": {"every_steps": 100},
            "eval": {"every_steps": 100, "max_samples": 4},
            "scale": {"num_workers": 1},
        }
    )
    job = WorkerJob(
        train=cfg, seed=0, examples_dir=examples, tokenizer_dir=tmp_path, config_hash="t"
    )
    run_dir = tmp_path / "run"
    run_worker(job, LocalContext(run_dir))
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [s["seq_len"] for s in steps] == expected_lengths
    # Tokens counted are the cut batch's real tokens, not the full rows'.
    order, cursor, expected = GlobalOrder(16, 0, 4), Cursor(), 0
    for step_length in expected_lengths:
        _, indices, cursor = order.next_batch(cursor)
        expected += int(np.minimum(lengths[indices], step_length).sum())
    meta = json.loads(next(run_dir.glob("checkpoint_step-*/meta.json")).read_text())
    assert meta["tokens_seen"] == expected
