"""`train.attention`: FlexAttention for document-masked causal blocks, and batches with no mask.

On a CPU the flex path runs eagerly and forward only (FlexAttention has no CPU backward, and
compiling it there takes minutes); the `gpu` test runs it compiled, forward and backward.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from tasks.common import schema
from training.models.config import CAUSAL_ATTENTION_DROPOUT, DocumentAttention, Value
from training.models.models import FAMILIES, Family, ModelConfig, build_model
from training.pretrain.config import TrainConfig
from training.pretrain.data import DOCUMENT_IDS, BatchBuilder
from training.pretrain.losses import pretraining_loss
from training.pretrain.losses.common import POSITION_IDS
from training.pretrain.losses.decoder import causal_logits
from training.pretrain.packing import document_ids, document_positions

# On a CPU FlexAttention runs uncompiled on purpose (see the module docstring).
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VOCAB, PAD, L = 64, 0, 24
SPECIALS: dict[str, int | None] = {"pad": PAD, "eos": 3, "vocab_size": VOCAB}
# Block 0: documents at 0, 6 and 15, padding (a run of pad ids) from 20; block 1: at 0 and 10.
STARTS = [[6, 15, 20], [10]]
_ROPE = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
#: Every family that packs documents, two layers of width 32; Mistral with grouped-query heads
#: and a sliding window shorter than its documents, so the block mask must keep both.
SHAPES: dict[Family, dict[str, Value]] = {
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_inner": 64},
    "llama": _ROPE | {"num_key_value_heads": 4, "intermediate_size": 64},
    "mistral": _ROPE | {"num_key_value_heads": 2, "intermediate_size": 64, "sliding_window": 4},
    "mixtral": _ROPE | {"num_key_value_heads": 4, "intermediate_size": 32},
}


def tiny(family: Family, attention: DocumentAttention, size: int = L) -> torch.nn.Module:
    cfg = ModelConfig(family=family, size="tiny", overrides=SHAPES[family], dropout=0.0)
    torch.manual_seed(0)  # the same weights under either attention
    return build_model(cfg, "causal", VOCAB, SPECIALS, size, attention).eval()


def packed(ids: torch.Tensor, starts: list[list[int]] = STARTS) -> dict[str, torch.Tensor]:
    length = ids.shape[1]
    return {
        schema.INPUT_IDS: ids,
        DOCUMENT_IDS: torch.from_numpy(document_ids(starts, length)),
        POSITION_IDS: torch.from_numpy(document_positions(starts, length)),
    }


def random_ids(length: int = L) -> torch.Tensor:
    ids = torch.randint(5, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    ids[0, length - 4 :] = PAD  # block 0 ends in padding, a document of its own (`STARTS`)
    return ids


@pytest.mark.slow  # FlexAttention's first eager call per shape traces it (about a second)
@pytest.mark.parametrize("family", list(SHAPES))
def test_flex_attention_gives_the_dense_document_masks_logits_and_loss(family: Family) -> None:
    batch = packed(random_ids())
    dense, flex = tiny(family, "dense"), tiny(family, "flex")
    with torch.no_grad():
        want = causal_logits(dense, batch)  # (B, L, V)
        torch.testing.assert_close(causal_logits(flex, batch), want, rtol=1e-5, atol=1e-5)
        loss, flex_loss = (pretraining_loss(m, "causal", batch) for m in (dense, flex))
    assert set(loss.parts) == ({"lm_loss", "aux_loss"} if family == "mixtral" else {"lm_loss"})
    torch.testing.assert_close(flex_loss.parts, loss.parts)


@pytest.mark.slow
def test_under_flex_attention_a_document_never_sees_another() -> None:
    model = tiny("mistral", "flex")  # grouped-query heads and a sliding window
    ids = random_ids()
    changed = ids.clone()
    changed[0, 6:15] = (changed[0, 6:15] + 1) % VOCAB  # rewrite the middle document of block 0
    with torch.no_grad():
        base, after = causal_logits(model, packed(ids)), causal_logits(model, packed(changed))
    assert torch.equal(after[0, :6], base[0, :6])  # the document before it
    assert torch.equal(after[0, 15:], base[0, 15:])  # the document after it, and the padding
    assert torch.equal(after[1], base[1])  # the other block
    assert not torch.allclose(after[0, 6:15], base[0, 6:15])  # the document itself


def test_blocks_of_one_document_and_unpadded_rows_carry_no_mask() -> None:
    ids = np.arange(2 * 8, dtype=np.uint16).reshape(2, 8)
    causal = BatchBuilder("causal", document_masking=True)
    one_each = causal({schema.INPUT_IDS: ids, schema.DOC_STARTS: [[], []]}, np.arange(2), 0)
    assert set(one_each) == {schema.INPUT_IDS}  # SDPA's causal kernel, no mask built
    two = causal({schema.INPUT_IDS: ids, schema.DOC_STARTS: [[], [5]]}, np.arange(2), 0)
    assert set(two) == {schema.INPUT_IDS, DOCUMENT_IDS, POSITION_IDS}

    def roberta(lengths: list[int]) -> dict[str, Any]:
        rows = {
            schema.INPUT_IDS: ids,
            schema.LENGTH: np.asarray(lengths, dtype=np.int32),
            schema.LABELS: np.where(ids % 3 == 0, ids, -100).astype(np.int32),
        }
        return BatchBuilder("roberta")(rows, np.arange(2), 0)

    assert "attention_mask" not in roberta([8, 8])
    assert roberta([8, 5])["attention_mask"].sum(dim=1).tolist() == [8, 5]


def train_config(family: str, **train: Any) -> TrainConfig:
    gpu = train.pop("use_gpu", True)
    model = {"family": family, "size": "tiny"} | train.pop("model", {})
    return TrainConfig.model_validate(
        {"model": model, "document_masking": True, "scale": {"use_gpu": gpu}, **train}
    )


def test_auto_attention_is_flex_where_flex_can_train_and_dense_elsewhere() -> None:
    assert train_config("llama").document_attention() == "flex"
    assert train_config("gpt2", model={"dropout": 0.0}).document_attention() == "flex"
    assert train_config("llama", use_gpu=False).document_attention() == "dense"
    assert train_config("gpt2").document_attention() == "dense"  # attn_pdrop 0.1
    assert train_config("llama", document_masking=False).document_attention() == "dense"
    assert train_config("bert").document_attention() == "dense"
    assert train_config("llama", use_gpu=False, attention="dense").document_attention() == "dense"


@pytest.mark.parametrize(
    ("family", "train", "reason"),
    [
        ("bert", {}, "train.model.family bert packs none"),
        ("llama", {"document_masking": False}, "train.document_masking is false"),
        ("llama", {"use_gpu": False}, "needs a GPU"),
        ("gpt2", {}, "gpt2's attn_pdrop is 0.1"),
        ("mistral", {"model": {"overrides": {"attention_dropout": 0.1}}}, "attention_dropout"),
    ],
)
def test_flex_attention_where_it_cannot_train_is_refused_naming_the_key(
    family: str, train: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValidationError, match=f"train.attention flex .*{reason}"):
        train_config(family, attention="flex", **train)


def test_attention_dropout_defaults_are_transformers_own() -> None:
    for family, (field, default) in CAUSAL_ATTENTION_DROPOUT.items():
        assert getattr(FAMILIES[family].config(), field) == default, family  # type: ignore[index]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "length", "starts"),
    [
        # A tile of 128 and a partial one; a document across the tile boundary, one on it.
        ("gpt2", 200, [[40, 150, 196], [128]]),
        # One partial tile (compiled on a CPU, FlexAttention got this case wrong).
        ("mistral", 64, [[10, 40, 60], [32]]),
    ],
)
def test_compiled_flex_attention_trains_like_the_dense_mask_on_a_gpu(
    family: Family, length: int, starts: list[list[int]]
) -> None:
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU: torch.cuda.is_available() is false"
        if os.environ.get("LMPIPE_REQUIRE_GPU", "0") not in ("", "0"):
            pytest.fail(reason)
        pytest.skip(reason)
    batch = {k: v.cuda() for k, v in packed(random_ids(length), starts).items()}
    grads = []
    for attention in ("dense", "flex"):
        model = tiny(family, attention, length).cuda().train()
        loss = torch.compile(functools.partial(pretraining_loss, model, "causal"))(batch).loss
        loss.backward()  # type: ignore[no-untyped-call]
        grads.append((loss.detach(), [p.grad for p in model.parameters()]))
    (dense_loss, dense_grads), (flex_loss, flex_grads) = grads
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-4)
    for flex_grad, dense_grad in zip(flex_grads, dense_grads, strict=True):
        torch.testing.assert_close(flex_grad, dense_grad, rtol=1e-3, atol=1e-4)
