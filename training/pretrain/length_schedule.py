"""The sequence-length schedule (`train.length_schedule`): each step's length, rows cut to it.

One run trains at several lengths from examples cut at the full length: BERT's 90% of the
steps at 128 tokens and the rest at 512 (`staged`), or every N-th step at the full length and
the others short (`alternate`). `length_at` says which length an optimizer step trains at;
`rows_at_length` cuts rows as `ExampleShards.take` returns them, before dynamic masking, so no
label points past the cut:

- masked LM, one segment (roberta): the first L tokens, the last of them replaced by the row's
  closing separator (`</s>`, `[SEP]`); the static label under it is dropped.
- masked LM, sentence pairs (bert, sop): both segments kept, trimmed longest first (BERT's
  `truncate_seq_pair`, from the end), so the pair label still has its two segments.
- causal: each block of T tokens becomes T/L blocks of L (every token kept, in order), with its
  document starts split to match, exactly as if the example stage had cut blocks of L.

Seq2seq examples (span_corruption) have no length to cut and refuse a schedule. The loop's
wiring is in training/pretrain/loop.py (`Worker.train_step`); evaluation always uses the full
length.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.common import schema

MLM_OBJECTIVES = ("bert", "sop", "roberta")
_IGNORE_INDEX = -100  # a label that is not predicted


class LengthScheduleError(ValueError):
    """The schedule does not fit these examples (objective or length)."""


class LengthStage(BaseModel):
    """One stage of a staged schedule: `length` tokens until `until_step` steps are done."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    until_step: int | None = Field(
        None,
        ge=1,
        description="The stage ends once this many optimizer steps of the run are done; "
        "null: it runs to the end (the last stage, and only it).",
    )
    length: int = Field(ge=8, description="Tokens per sequence, specials included.")


class StagedLengths(BaseModel):
    """Consecutive stages, each at one length (BERT: 90% of the steps at 128, then 512)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    mode: Literal["staged"]
    stages: list[LengthStage] = Field(
        min_length=1, description="In order; `until_step` increasing, the last one null."
    )

    @model_validator(mode="after")
    def _stages_cover_the_run(self) -> StagedLengths:
        *closed, last = self.stages
        if last.until_step is not None:
            raise ValueError(
                f"stages[{len(closed)}].until_step={last.until_step}: the last stage runs to "
                "the end of the run; set its until_step to null"
            )
        previous = 0
        for i, stage in enumerate(closed):
            if stage.until_step is None:
                raise ValueError(
                    f"stages[{i}].until_step is null: only the last stage is open-ended"
                )
            if stage.until_step <= previous:
                raise ValueError(
                    f"stages[{i}].until_step={stage.until_step} must be greater than "
                    f"stages[{i - 1}].until_step={previous}"
                )
            previous = stage.until_step
        return self


class AlternateLengths(BaseModel):
    """Every `every`-th optimizer step at the full length, the others at `short`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    mode: Literal["alternate"]
    short: int = Field(128, ge=8, description="Tokens per sequence of the short steps.")
    every: int = Field(
        ge=2,
        description="Steps N, 2N, 3N, ... (counted from 1) run at the full length.",
    )


#: `train.length_schedule`: `mode` picks the shape.
LengthSchedule = Annotated[StagedLengths | AlternateLengths, Field(discriminator="mode")]


def schedule_lengths(schedule: StagedLengths | AlternateLengths) -> list[int]:
    """Every length the schedule names (the full length of `alternate` not included)."""
    if isinstance(schedule, AlternateLengths):
        return [schedule.short]
    return [stage.length for stage in schedule.stages]


def length_at(
    schedule: StagedLengths | AlternateLengths | None, step: int, full_length: int
) -> int:
    """The sequence length of the optimizer step that follows `step` done steps (0-based).

    Args:
        schedule: `train.length_schedule`; None trains every step at `full_length`.
        step: Optimizer steps done before this one (the loop's `Worker.step`).
        full_length: The examples' length (`max_seq_length`, or `block_size` for causal).

    Raises:
        LengthScheduleError: the step's length exceeds `full_length`.
    """
    if schedule is None:
        return full_length
    if isinstance(schedule, AlternateLengths):
        length = full_length if (step + 1) % schedule.every == 0 else schedule.short
    else:
        length = next(
            s.length for s in schedule.stages if s.until_step is None or step < s.until_step
        )
    if length > full_length:
        raise LengthScheduleError(
            f"train.length_schedule: length {length} at step {step + 1} exceeds the examples' "
            f"length {full_length}; cut the examples at least that long"
        )
    return length


def check_length_schedule(
    schedule: StagedLengths | AlternateLengths | None, objective: str, full_length: int
) -> None:
    """Refuse a schedule these examples cannot follow, naming the field and the fix.

    Raises:
        LengthScheduleError: a seq2seq objective, a length over `full_length`, or (causal)
            a length that does not divide the block size.
    """
    if schedule is None:
        return
    if objective not in (*MLM_OBJECTIVES, "causal"):
        raise LengthScheduleError(
            f"train.length_schedule applies to masked-LM ({', '.join(MLM_OBJECTIVES)}) and "
            f"causal examples, not {objective!r} (its inputs and targets are cut together "
            "by the example stage); remove train.length_schedule"
        )
    for length in schedule_lengths(schedule):
        if length > full_length:
            raise LengthScheduleError(
                f"train.length_schedule: length {length} exceeds the examples' length "
                f"{full_length} (examples.max_seq_length / examples.block_size)"
            )
        if objective == "causal" and full_length % length:
            raise LengthScheduleError(
                f"train.length_schedule: length {length} does not divide the causal "
                f"block_size {full_length}; each block is split into block_size / length blocks"
            )


def rows_at_length(rows: dict[str, Any], objective: str, length: int) -> dict[str, Any]:
    """`rows` (from `ExampleShards.take`) cut to `length` tokens; unchanged at full length.

    Raises:
        LengthScheduleError: a seq2seq objective, or a length the rows cannot be cut to.
    """
    width = rows[schema.INPUT_IDS].shape[1]
    if length == width:
        return rows
    if length > width:
        raise LengthScheduleError(f"cannot cut rows of {width} tokens to {length}")
    if objective in MLM_OBJECTIVES and schema.TOKEN_TYPE_IDS in rows:
        return trim_pair_rows(rows, length)
    if objective in MLM_OBJECTIVES:
        return truncate_rows(rows, length)
    if objective == "causal":
        return split_blocks(rows, length)
    raise LengthScheduleError(f"{objective!r} examples have no sequence length to cut")


def _gather(rows: dict[str, Any], src: np.ndarray) -> dict[str, Any]:
    """Every (N, T) column taken at `src` (N, L); per-row values as they are."""
    width = rows[schema.INPUT_IDS].shape[1]
    return {
        name: np.take_along_axis(values, src, axis=1)
        if isinstance(values, np.ndarray) and values.ndim == 2 and values.shape[1] == width
        else values
        for name, values in rows.items()
    }


def truncate_rows(rows: dict[str, Any], length: int) -> dict[str, Any]:
    """`<s> x </s>` rows cut to their first `length` tokens, still closed by their separator.

    The closing separator of a row that loses tokens overwrites its last kept slot, whose static
    label (if any) is dropped with the labels past the cut.
    """
    lengths = rows[schema.LENGTH].astype(np.int64)  # (N,)
    n = len(lengths)
    closing = rows[schema.INPUT_IDS][np.arange(n), lengths - 1]  # (N,) specials: never masked
    out = _gather(rows, np.broadcast_to(np.arange(length), (n, length)))
    cut = lengths > length  # (N,) rows that lose tokens
    out[schema.INPUT_IDS][cut, length - 1] = closing[cut]
    if schema.LABELS in out:
        out[schema.LABELS][cut, length - 1] = _IGNORE_INDEX
    out[schema.LENGTH] = np.minimum(lengths, length).astype(rows[schema.LENGTH].dtype)
    return out


def trim_pair_rows(rows: dict[str, Any], length: int) -> dict[str, Any]:
    """`[CLS] A [SEP] B [SEP]` rows fitted into `length` tokens, both segments kept.

    The longer segment loses its last token until the pair fits (BERT's `truncate_seq_pair`),
    so a row that is cut fills exactly `length` slots. Token types and static labels move with
    their tokens; the labels of dropped tokens go with them.
    """
    types = rows[schema.TOKEN_TYPE_IDS]  # (N, T), 0 up to the middle [SEP], 1 after it
    lengths = rows[schema.LENGTH].astype(np.int64)  # (N,)
    real = np.arange(types.shape[1])[None, :] < lengths[:, None]  # (N, T)
    len_a = ((types == 0) & real).sum(axis=1) - 2  # (N,) less [CLS] and the middle [SEP]
    len_b = lengths - 3 - len_a
    budget = length - 3
    # Longest first: the shorter segment stays whole if it fits in half, else both get half.
    keep_a = np.minimum(len_a, np.maximum(budget - len_b, (budget + 1) // 2))
    keep_b = np.minimum(len_b, budget - keep_a)
    fits = lengths <= length
    keep_a, keep_b = np.where(fits, len_a, keep_a), np.where(fits, len_b, keep_b)
    slot = np.arange(length)[None, :]  # (1, L)
    # [CLS] and A's first tokens stay; the middle [SEP] and B move left by the A tokens
    # dropped; the final [SEP] by the B tokens dropped too.
    src = slot + np.where(slot > keep_a[:, None], (len_a - keep_a)[:, None], 0)
    src = src + np.where(slot > (keep_a + keep_b + 1)[:, None], (len_b - keep_b)[:, None], 0)
    out = _gather(rows, src)  # (N, L) each
    out[schema.LENGTH] = np.minimum(lengths, length).astype(rows[schema.LENGTH].dtype)
    return out


def split_blocks(rows: dict[str, Any], length: int) -> dict[str, Any]:
    """Causal blocks of T tokens as T/L blocks of `length`, in order; document starts split.

    A document start at a new block's first position is no boundary (as in the example stage's
    `causal_blocks`): a document that runs across the cut restarts its positions there, as one
    running across two examples does.

    Raises:
        LengthScheduleError: `length` does not divide T.
    """
    ids = rows[schema.INPUT_IDS]  # (B, T)
    blocks, width = ids.shape
    if width % length:
        raise LengthScheduleError(f"length {length} does not divide the block size {width}")
    parts = width // length
    out: dict[str, Any] = {}
    for name, values in rows.items():
        if name == schema.DOC_STARTS:
            out[name] = _split_starts(values, length, parts)
        elif isinstance(values, np.ndarray) and values.ndim == 2:
            out[name] = values.reshape(blocks * parts, length)  # (B * T/L, L), row-major
        else:
            out[name] = np.repeat(values, parts, axis=0)
    return out


def _split_starts(doc_starts: list[list[int]], length: int, parts: int) -> list[list[int]]:
    """Each block's document starts as those of its `parts` pieces of `length` tokens."""
    out: list[list[int]] = []
    for starts in doc_starts:
        pieces: list[list[int]] = [[] for _ in range(parts)]
        for start in starts:
            piece, offset = divmod(int(start), length)
            if offset:
                pieces[piece].append(offset)
        out += pieces
    return out
