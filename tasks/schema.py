"""Column names and Arrow schemas shared by every data stage.

Only names and `pa.schema` objects live here: no I/O and no logic beyond checking that a table
has the columns a core function needs.
"""

from __future__ import annotations

import pyarrow as pa

#: Bumped whenever a stage's output schema or manifest layout changes incompatibly.
SCHEMA_VERSION = 1

DOC_ID = "doc_id"
SOURCE = "source"
SOURCE_FILE = "source_file"
OFFSET = "offset"
LINE = "line"
TEXT = "text"
SENTENCES = "sentences"

#: One ingested document. `offset` is the byte offset of the record in the decompressed input
#: (the row index for tabular inputs); `line` is its 1-based line number, null for tabular inputs.
DOCUMENTS = pa.schema(
    [
        pa.field(DOC_ID, pa.string(), nullable=False),
        pa.field(SOURCE, pa.string(), nullable=False),
        pa.field(SOURCE_FILE, pa.string(), nullable=False),
        pa.field(OFFSET, pa.int64(), nullable=False),
        pa.field(LINE, pa.int64()),
        pa.field(TEXT, pa.large_string(), nullable=False),
        pa.field(SENTENCES, pa.list_(pa.string()), nullable=False),
    ]
)

NUM_TOKENS = "num_tokens"
TOKEN_IDS = "token_ids"


def tokens_schema(ids: pa.DataType) -> pa.Schema:
    """One encoded document: its ids per sentence (`list<list<ids>>`) and its token count.

    The outer list is the document, each inner list one sentence encoded with the whitespace
    before it, so flattening both levels gives ids that decode to the document's text (document
    boundaries, for packing) and the inner lists give sentence boundaries (for sentence pairs).
    `ids` is uint16 when the vocabulary fits, uint32 otherwise.
    """
    return pa.schema(
        [
            pa.field(DOC_ID, pa.string(), nullable=False),
            pa.field(NUM_TOKENS, pa.int32(), nullable=False),
            pa.field(TOKEN_IDS, pa.list_(pa.list_(ids)), nullable=False),
        ]
    )


REASON = "reason"
DETAIL = "detail"
EXCERPT = "excerpt"

#: One quarantined record: where it came from, why it was set aside, and a bounded excerpt.
QUARANTINE = pa.schema(
    [
        pa.field(SOURCE, pa.string(), nullable=False),
        pa.field(SOURCE_FILE, pa.string(), nullable=False),
        pa.field(OFFSET, pa.int64(), nullable=False),
        pa.field(LINE, pa.int64()),
        pa.field(REASON, pa.string(), nullable=False),
        pa.field(DETAIL, pa.string(), nullable=False),
        pa.field(EXCERPT, pa.binary(), nullable=False),
    ]
)


class SchemaError(ValueError):
    """A table lacks a column a core function needs, or has it with the wrong type."""


def require_columns(table: pa.Table, *names: str) -> None:
    """Raise `SchemaError` naming every column of `names` that `table` lacks."""
    missing = [name for name in names if name not in table.column_names]
    if missing:
        raise SchemaError(f"missing column(s) {missing}; table has {table.column_names}")
