"""What the encode tests give `encode_documents`: a documents table from plain texts.

Imported by tests/tasks/encode/test_encode.py and tests/tasks/tokenizer/test_char.py.
"""

from __future__ import annotations

import pyarrow as pa

from tasks.common import schema
from tasks.ingest.text import SentenceConfig, split_sentences


def documents(texts: list[str]) -> pa.Table:
    """Ids, texts and the ingest stage's sentence split of `texts`, as ingest writes them."""
    column = pa.array(texts, pa.large_string())
    return pa.table(
        {
            schema.DOC_ID: pa.array([f"d{i}" for i in range(len(texts))]),
            schema.TEXT: column,
            schema.SENTENCES: split_sentences(column, SentenceConfig()),
        }
    )
