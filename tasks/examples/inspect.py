"""Render a few examples as text for a person to eyeball: masks, segments, spans, sentinels.

Also BART's noised inputs next to the original text.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from tasks.common import schema


def _pieces(tok: Tokenizer, ids: np.ndarray) -> list[str]:
    return [tok.id_to_token(int(i)) or f"<{int(i)}>" for i in ids]


def render_examples(table: pa.Table, objective: str, tok: Tokenizer, count: int) -> list[str]:
    """Describe the first `count` examples of `table`, one block of text each.

    Masked positions show as `[MASK→orig]`, `{random→orig}` or `(kept orig)`; segment B of a
    pair follows `‖`; causal blocks mark each document start with `¶`; span-corruption inputs
    and targets are shown piece by piece, sentinels included; denoising shows the noised input
    (masks and shuffled sentences) above the original text.
    """
    rows = table.slice(0, count).to_pylist()
    out = []
    for n, row in enumerate(rows):
        ids = np.asarray(row[schema.INPUT_IDS])
        if objective in ("bert", "sop", "roberta"):
            out.append(_masked(n, row, ids, objective, tok))
        elif objective == "causal":
            starts = set(row[schema.DOC_STARTS])
            shown = [("¶ " if i in starts else "") + p for i, p in enumerate(_pieces(tok, ids))]
            out.append(f"#{n} causal block, {len(starts)} document start(s)\n" + " ".join(shown))
        elif objective == "denoising":
            length = int(row[schema.LENGTH])
            inputs = " ".join(_pieces(tok, ids[:length]))
            labels = _pieces(tok, np.asarray(row[schema.LABELS]))
            while labels and labels[-1] in ("<pad>", "[PAD]"):
                labels.pop()
            out.append(f"#{n} denoising\n  inputs: {inputs}\n  labels: {' '.join(labels)}")
        else:
            inputs = " ".join(_pieces(tok, ids))
            targets = " ".join(_pieces(tok, np.asarray(row[schema.LABELS])))
            out.append(f"#{n} span corruption\n  inputs:  {inputs}\n  targets: {targets}")
    return out


def _masked(n: int, row: dict[str, object], ids: np.ndarray, objective: str, tok: Tokenizer) -> str:
    length = int(row[schema.LENGTH])  # type: ignore[call-overload]
    labels = np.asarray(row.get(schema.LABELS) or [-100] * len(ids))
    types = np.asarray(row.get(schema.TOKEN_TYPE_IDS) or [0] * len(ids))
    shown = []
    for i in range(length):
        piece = tok.id_to_token(int(ids[i])) or "?"
        if labels[i] != -100:
            orig = tok.id_to_token(int(labels[i])) or "?"
            if piece == orig:
                piece = f"(kept {orig})"
            elif tok.token_to_id(piece) is not None and piece.strip("[]<>").lower() == "mask":
                piece = f"[MASK→{orig}]"
            else:
                piece = f"{{{piece}→{orig}}}"
        if i and types[i] != types[i - 1]:
            shown.append("‖")
        shown.append(piece)
    header = f"#{n} {objective}, {length} tokens"
    if objective == "bert":
        header += ", NotNext" if row[schema.NEXT_SENTENCE_LABEL] else ", IsNext"
    elif objective == "sop":
        header += ", swapped" if row[schema.SENTENCE_ORDER_LABEL] else ", in order"
    if schema.SOURCE_DOC in row:
        header += f" (documents {row[schema.SOURCE_DOC]} / {row[schema.PAIR_DOC]})"
    return header + "\n" + " ".join(shown)
