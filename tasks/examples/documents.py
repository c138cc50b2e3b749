"""An encode shard as flat NumPy arrays: token ids, sentence offsets, document offsets."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.common import schema


@dataclass(frozen=True)
class EncodedDocs:
    """An encode shard as flat arrays: token ids, sentence offsets, document offsets.

    Document d holds sentences `doc_offsets[d]:doc_offsets[d+1]`; sentence s holds tokens
    `ids[sent_offsets[s]:sent_offsets[s+1]]`.
    """

    ids: np.ndarray  # (T,)
    sent_offsets: np.ndarray  # (S + 1,)
    doc_offsets: np.ndarray  # (D + 1,)

    @property
    def documents(self) -> int:
        """Number of documents."""
        return len(self.doc_offsets) - 1

    def sentences(self, doc: int) -> list[np.ndarray]:
        """The sentences of document `doc`, as id arrays (views, no copy)."""
        start, stop = self.doc_offsets[doc], self.doc_offsets[doc + 1]
        bounds = self.sent_offsets[start : stop + 1]
        return [self.ids[a:b] for a, b in pairwise(bounds)]

    def document(self, doc: int) -> np.ndarray:
        """All ids of document `doc`, flat (a view)."""
        lo = self.sent_offsets[self.doc_offsets[doc]]
        hi = self.sent_offsets[self.doc_offsets[doc + 1]]
        return self.ids[lo:hi]


def encoded_docs(table: pa.Table) -> EncodedDocs:
    """View an encode shard's `token_ids` column as flat arrays (no Python object per token)."""
    schema.require_columns(table, schema.TOKEN_IDS)
    column = table.column(schema.TOKEN_IDS).combine_chunks()
    per_doc = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    sentences = pc.list_flatten(column)
    per_sentence = pc.list_value_length(sentences).to_numpy(zero_copy_only=False)
    ids = pc.list_flatten(sentences).to_numpy(zero_copy_only=False)
    return EncodedDocs(
        ids=ids,
        sent_offsets=np.concatenate([[0], np.cumsum(per_sentence, dtype=np.int64)]),
        doc_offsets=np.concatenate([[0], np.cumsum(per_doc, dtype=np.int64)]),
    )
