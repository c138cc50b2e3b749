"""Training data: memory-mapped example shards, the seeded global order, batches as tensors.

Every rank opens the example shards by memory map and reads samples by global index. The order
is a seeded permutation per epoch; each optimizer step takes the next `global_batch_size`
indices of it and splits them by rank, so the data position is one cursor (epoch, offset),
stored in every checkpoint, and a resume at any worker count continues from it. Dynamic masking
keys each sample by (seed, epoch, global index), the rule of the example stage.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from tokenizers import Tokenizer

from tasks.common import schema
from tasks.common.io import read_ipc_stream, safe_join, sha256_file
from tasks.examples.objectives.masking import MaskConfig, mask_tokens, word_start_table
from tasks.examples.objectives.rng import sample_keys
from training.pretrain.length_schedule import rows_at_length
from training.pretrain.packing import document_ids, document_positions

log = logging.getLogger(__name__)
_PERMUTATION_SALT = 0x0D_A7A0  # keeps the order's stream apart from other seeded draws
#: The epoch the validation split is masked with (dynamic masking): fixed, apart from training.
EVAL_EPOCH = (1 << 62) + 7
#: A split of several chunks whose columns take at most this many bytes is also held whole.
WHOLE_BYTES = 64 << 20


class DataError(ValueError):
    """An example directory or shard is missing, incomplete or corrupt."""


def read_manifest(examples_dir: Path) -> dict[str, Any]:
    """The example stage's manifest; a missing or incomplete output is refused."""
    path = examples_dir / "manifest.json"
    if not path.is_file():
        raise DataError(f"{path}: no example manifest (run `lmpipe examples` first)")
    manifest: dict[str, Any] = json.loads(path.read_text())
    if manifest.get("stage") != "examples":
        raise DataError(f"{path}: stage is {manifest.get('stage')!r}, expected 'examples'")
    return manifest


def sequence_length(manifest: dict[str, Any]) -> int:
    """Tokens per example of an examples manifest (`sequence_length`).

    A manifest written before that key existed gives `block_size` for causal blocks, else
    `max_seq_length`, from its config.
    """
    if "sequence_length" in manifest:
        return int(manifest["sequence_length"])
    key = "block_size" if manifest["objective"] == "causal" else "max_seq_length"
    return int(manifest["config"][key])


class ExampleShards:
    """One split's example shards, memory-mapped, addressed by a global sample index."""

    def __init__(self, examples_dir: Path, split: str, *, verify: bool = True) -> None:
        """Open every shard of `split`; with `verify`, check each file's sha256 first."""
        manifest = read_manifest(examples_dir)
        entries = manifest["splits"][split]["shards"]
        self.objective: str = manifest["objective"]
        self.columns: dict[str, list[np.ndarray]] = {}
        self.doc_starts: list[pa.Array] = []
        bounds = [0]
        for entry in entries:
            path = safe_join(examples_dir, entry["name"], what="example shard")
            if not path.is_file():
                raise DataError(f"{path}: example shard listed in the manifest is missing")
            if verify and sha256_file(path) != entry["sha256"]:
                raise DataError(f"{path}: sha256 differs from the manifest (corrupt shard)")
            table = read_ipc_stream(path)
            if table.num_rows != entry["rows"]:
                raise DataError(f"{path}: {table.num_rows} rows, manifest says {entry['rows']}")
            for chunk in table.to_batches():
                self._add_chunk(chunk)
                bounds.append(bounds[-1] + chunk.num_rows)
        self.bounds = np.asarray(bounds, dtype=np.int64)  # (chunks + 1,)
        # A small split is also held whole, one array per column, so a step's rows are one
        # gather (its chunks' bookkeeping is a dozen NumPy calls a step); a large one is only
        # memory-mapped. At most `WHOLE_BYTES` of memory, copied once.
        size = sum(part.nbytes for parts in self.columns.values() for part in parts)
        self.whole: dict[str, np.ndarray] | None = None
        if len(bounds) > 2 and size <= WHOLE_BYTES:
            self.whole = {name: np.concatenate(parts) for name, parts in self.columns.items()}

    def _add_chunk(self, chunk: pa.RecordBatch) -> None:
        for name, column in zip(chunk.schema.names, chunk.columns, strict=True):
            if name == schema.DOC_STARTS:
                self.doc_starts.append(column)
            elif pa.types.is_fixed_size_list(column.type):
                width = column.type.list_size
                values = column.flatten().to_numpy(zero_copy_only=False)  # views the mmap
                self.columns.setdefault(name, []).append(values.reshape(-1, width))
            else:
                self.columns.setdefault(name, []).append(column.to_numpy(zero_copy_only=False))

    def __len__(self) -> int:
        """Samples in the split."""
        return int(self.bounds[-1])

    @property
    def width(self) -> int:
        """Tokens per row: the examples' full length (`max_seq_length`, `block_size`)."""
        return int(self.columns[schema.INPUT_IDS][0].shape[1])

    def take(self, indices: np.ndarray, doc_starts: bool = True) -> dict[str, Any]:
        """The rows at `indices` (global), in that order: (N, L) arrays and doc-start lists.

        `doc_starts` False leaves the doc-start lists out (a Python object per row: what a
        step's take costs most, for a batch builder that does not read them).
        """
        want_starts = bool(self.doc_starts) and doc_starts
        if self.whole is not None and not want_starts:
            return {name: column[indices] for name, column in self.whole.items()}
        chunk = np.searchsorted(self.bounds, indices, side="right") - 1  # (N,)
        local = indices - self.bounds[chunk]
        out: dict[str, Any] = {}
        # One gather per chunk the rows come from, not one per row (a step's batch touches few)
        chunks = np.unique(chunk)
        for name, parts in self.columns.items():
            if len(chunks) == 1:
                out[name] = parts[chunks[0]][local]
                continue
            rows = np.empty((len(indices), *parts[0].shape[1:]), dtype=parts[0].dtype)
            for c in chunks:
                at = chunk == c
                rows[at] = parts[c][local[at]]
            out[name] = rows
        if want_starts:
            out[schema.DOC_STARTS] = [
                self.doc_starts[c][int(r)].as_py() for c, r in zip(chunk, local, strict=True)
            ]
        return out


@dataclass
class Cursor:
    """The data position: the next step reads the epoch's permutation from `offset` on."""

    epoch: int = 0
    offset: int = 0
    samples: int = 0  # samples consumed since the start of the run


class GlobalOrder:
    """The seeded per-epoch permutation of a split and the cursor that walks it."""

    def __init__(self, size: int, seed: int, global_batch: int) -> None:
        """Order `size` samples; each step takes `global_batch`; an epoch's tail is dropped."""
        if size < global_batch:
            raise DataError(
                f"the train split has {size} examples, fewer than one global batch "
                f"({global_batch}): lower train.global_batch_size or add data"
            )
        self.size, self.seed, self.global_batch = size, seed, global_batch
        self._cached: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """(size,) int64: the order of `epoch`, the same on every rank and host."""
        if self._cached is None or self._cached[0] != epoch:
            seq = np.random.SeedSequence([self.seed, epoch, _PERMUTATION_SALT])
            self._cached = (epoch, np.random.Generator(np.random.PCG64(seq)).permutation(self.size))
        return self._cached[1]

    def next_batch(self, cursor: Cursor) -> tuple[int, np.ndarray, Cursor]:
        """The next step's (epoch, global indices) and the cursor after it."""
        epoch, offset = cursor.epoch, cursor.offset
        if offset + self.global_batch > self.size:  # the tail of an epoch is dropped
            epoch, offset = epoch + 1, 0
        indices = self.permutation(epoch)[offset : offset + self.global_batch]
        after = Cursor(epoch, offset + self.global_batch, cursor.samples + self.global_batch)
        return epoch, indices, after


def rank_micro_batches(indices: np.ndarray, rank: int, world: int, micro: int) -> list[np.ndarray]:
    """This rank's contiguous share of a global batch, cut into micro-batches."""
    share = len(indices) // world
    mine = indices[rank * share : (rank + 1) * share]
    return [mine[i : i + micro] for i in range(0, len(mine), micro)]


@dataclass(frozen=True)
class Masker:
    """Dynamic masking: the example stage's `mask_tokens`, keyed by (seed, epoch, index)."""

    cfg: MaskConfig
    seed: int
    mask_id: int
    special_ids: np.ndarray  # (S,) ids never masked
    random_ids: np.ndarray  # ids a random replacement is drawn from
    word_starts: np.ndarray | None  # (V,) bool, for whole-word masking

    def __call__(
        self, ids: np.ndarray, lengths: np.ndarray, epoch: int, indices: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Masked (N, L) ids and (N, L) labels (-100 where nothing is predicted)."""
        real = np.arange(ids.shape[1])[None, :] < lengths[:, None]  # (N, L)
        maskable = real & ~np.isin(ids, self.special_ids)
        starts = self.word_starts[ids] if self.word_starts is not None else None
        keys = sample_keys(self.seed, epoch, indices)
        out = mask_tokens(ids, maskable, starts, keys, self.cfg, self.mask_id, self.random_ids)
        return out.input_ids, out.labels


def dynamic_masker(manifest: dict[str, Any], tokenizer_dir: Path, seed: int) -> Masker | None:
    """The masker for dynamic masking, or None when the shards carry their labels."""
    config = manifest["config"]
    if config.get("masking") != "dynamic" or manifest["objective"] not in (
        "bert",
        "sop",
        "roberta",
    ):
        return None
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size(with_added_tokens=True))]
    specials = np.asarray(
        sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special), np.int64
    )
    cfg = MaskConfig.model_validate(config["mask"])
    family = json.loads((tokenizer_dir / "manifest.json").read_text())["config"]["family"]
    words = word_start_table(vocab, family, set(specials.tolist())) if cfg.whole_word else None
    return Masker(
        cfg=cfg,
        seed=seed,
        mask_id=int(manifest["specials"]["mask"]),
        special_ids=specials,
        random_ids=np.setdiff1d(np.arange(len(vocab)), specials),
        word_starts=words,
    )


#: A masked-LM batch's flat indices of its masked tokens (labels != -100), in row-major order:
#: the loss gathers those rows by index, with no host read of the labels on the device.
MASKED_POSITIONS = "masked_positions"
#: Document-masked causal batches: (B, L) the document each token belongs to in its block. The
#: loss builds the 4-D mask from it on the device (`training.pretrain.packing`).
DOCUMENT_IDS = "document_ids"


@dataclass(frozen=True)
class BatchBuilder:
    """Turns rows of one objective into the model's input tensors (int64, CPU).

    A batch without padding carries no `attention_mask`, and a document-masked causal batch of
    one document per row no `document_ids`: both are decided here from NumPy, so the device
    never has to be asked whether a mask may be dropped.
    """

    objective: str
    masker: Masker | None = None
    document_masking: bool = False

    @property
    def reads_doc_starts(self) -> bool:
        """Whether the rows it builds from need their doc-start lists (`ExampleShards.take`)."""
        return self.objective == "causal" and self.document_masking

    def __call__(
        self, rows: dict[str, Any], indices: np.ndarray, epoch: int, length: int | None = None
    ) -> dict[str, Any]:
        """The batch of `rows` (taken at global `indices`, in `epoch`), cut to `length` tokens.

        `length` (`train.length_schedule`; None: the rows' own) cuts the rows before dynamic
        masking, so no label lies past the cut; causal blocks become more, shorter blocks.
        """
        if length is not None:
            rows = rows_at_length(rows, self.objective, length)
        ids = rows[schema.INPUT_IDS].astype(np.int64)  # (B, L)
        batch: dict[str, Any] = {}
        if self.objective == "causal":
            return self._causal(ids, rows)
        if self.objective in ("span_corruption", "denoising"):
            batch[schema.LABELS] = rows[schema.LABELS].astype(np.int64)
            batch[schema.DECODER_INPUT_IDS] = rows[schema.DECODER_INPUT_IDS].astype(np.int64)
            if schema.LENGTH in rows:  # BART rows are padded: mask the encoder's padding
                lengths = rows[schema.LENGTH].astype(np.int64)
                mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
            else:  # T5 inputs are full (packed raw chunks)
                mask = np.ones_like(ids)
        else:  # bert, sop, roberta: masked LM
            lengths = rows[schema.LENGTH].astype(np.int64)
            mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
            if self.masker is not None:
                ids, labels = self.masker(ids, lengths, epoch, indices)
            else:
                labels = rows[schema.LABELS].astype(np.int64)
            batch[schema.LABELS] = labels
            batch[MASKED_POSITIONS] = np.flatnonzero(labels != -100)  # (M,)
            if schema.TOKEN_TYPE_IDS in rows:
                batch[schema.TOKEN_TYPE_IDS] = rows[schema.TOKEN_TYPE_IDS].astype(np.int64)
            for label in (schema.NEXT_SENTENCE_LABEL, schema.SENTENCE_ORDER_LABEL):
                if label in rows:
                    batch[label] = rows[label].astype(np.int64)
        batch[schema.INPUT_IDS] = ids
        if not mask.all():  # decided here, on the host: no mask lets SDPA run flash kernels
            batch["attention_mask"] = mask
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}

    def _causal(self, ids: np.ndarray, rows: dict[str, Any]) -> dict[str, Any]:
        batch: dict[str, Any] = {schema.INPUT_IDS: torch.from_numpy(ids)}
        if self.document_masking:
            starts, length = rows[schema.DOC_STARTS], ids.shape[1]
            documents = document_ids(starts, length)  # (B, L)
            if (documents[:, -1] == documents[:, 0]).all():
                # One document per row: plain causal attention is the document mask, and
                # without a mask SDPA runs its causal flash kernel (positions count from 0).
                return batch
            batch[DOCUMENT_IDS] = torch.from_numpy(documents)
            batch["position_ids"] = torch.from_numpy(document_positions(starts, length))
        return batch
