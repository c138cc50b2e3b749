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


INPUT_IDS = "input_ids"
TOKEN_TYPE_IDS = "token_type_ids"
LENGTH = "length"
LABELS = "labels"
NEXT_SENTENCE_LABEL = "next_sentence_label"
SENTENCE_ORDER_LABEL = "sentence_order_label"
DOC_STARTS = "doc_starts"
DECODER_INPUT_IDS = "decoder_input_ids"
SOURCE_DOC = "source_doc"
PAIR_DOC = "pair_doc"


def examples_schema(
    objective: str, length: int, ids: pa.DataType, *, labels: bool, targets_length: int = 0
) -> pa.Schema:
    """The fixed-length columns of one objective's examples.

    - bert / sop: `input_ids`, `token_type_ids`, `length` (real tokens), the pair label
      (`next_sentence_label`: 1 = B is random; `sentence_order_label`: 1 = swapped), `labels`
      (static masking: the original id at masked positions, -100 elsewhere; absent when
      masking is dynamic), and `source_doc` / `pair_doc` (document numbers within the split).
    - roberta: `input_ids`, `length`, `labels` (static masking only).
    - causal: `input_ids` and `doc_starts` (positions inside the block where a document starts).
    - span_corruption: `input_ids` (encoder), `labels` (`targets_length` ids) and
      `decoder_input_ids` (the targets shifted right behind the decoder start token).
    - denoising (BART): `input_ids` (`<s> noised </s>` then pad), `length` (real encoder
      tokens, for the attention mask), `labels` (`<s> original </s>` then pad; pad is not
      predicted) and `decoder_input_ids` (the labels shifted right behind `</s>`, BART's
      decoder start token); labels and decoder inputs are as wide as the encoder input.
    """

    def vector(type_: pa.DataType, width: int = length) -> pa.DataType:
        return pa.list_(type_, width)

    fields: list[pa.Field] = [pa.field(INPUT_IDS, vector(ids), nullable=False)]
    if objective in ("bert", "sop"):
        label = NEXT_SENTENCE_LABEL if objective == "bert" else SENTENCE_ORDER_LABEL
        fields += [
            pa.field(TOKEN_TYPE_IDS, vector(pa.uint8()), nullable=False),
            pa.field(LENGTH, pa.int32(), nullable=False),
            pa.field(label, pa.int8(), nullable=False),
            pa.field(SOURCE_DOC, pa.int64(), nullable=False),
            pa.field(PAIR_DOC, pa.int64(), nullable=False),
        ]
    elif objective in ("roberta", "denoising"):
        fields.append(pa.field(LENGTH, pa.int32(), nullable=False))
    elif objective == "causal":
        fields.append(pa.field(DOC_STARTS, pa.list_(pa.int32()), nullable=False))
    if objective in ("span_corruption", "denoising"):
        width = targets_length if objective == "span_corruption" else length
        fields += [
            pa.field(LABELS, vector(ids, width), nullable=False),
            pa.field(DECODER_INPUT_IDS, vector(ids, width), nullable=False),
        ]
    elif labels:  # static masking
        fields.append(pa.field(LABELS, vector(pa.int32()), nullable=False))
    return pa.schema(fields)


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


# Downstream (fine-tuning and evaluation) examples: the canonical columns every task type's
# reader produces, whatever the source file called them. `tasks/downstream/downstream.py` writes
# them; `training/` reads them. Labels are stored as indexes into the task's label list.
EXAMPLE_ID = "example_id"
TEXT_PAIR = "text_pair"
LABEL = "label"
TOKENS = "tokens"
TAGS = "tags"
QUESTION = "question"
CONTEXT = "context"
ANSWER_TEXTS = "answer_texts"
ANSWER_STARTS = "answer_starts"
TARGET = "target"
PROMPT = "prompt"
RESPONSE = "response"

#: Task types and the columns of their tables (beyond `example_id`, a string unique per split).
DOWNSTREAM_TASK_TYPES = (
    "classification",  # text (+ text_pair), label: int32 index into the label list
    "regression",  # text (+ text_pair), label: float32
    "token_classification",  # tokens: list<string>, tags: list<int32> (BIO label indexes)
    "question_answering",  # question, context, answer_texts, answer_starts ([] = unanswerable)
    "seq2seq",  # text (source, without the T5 prefix), target
    "causal_lm",  # prompt, response (loss on the response only)
)


def downstream_schema(task_type: str, pair: bool = False) -> pa.Schema:
    """Return the Arrow schema of a downstream table of `task_type` (`pair`: has `text_pair`)."""
    text = pa.field(TEXT, pa.string(), nullable=False)
    fields = [pa.field(EXAMPLE_ID, pa.string(), nullable=False)]
    if task_type in ("classification", "regression"):
        fields.append(text)
        if pair:
            fields.append(pa.field(TEXT_PAIR, pa.string(), nullable=False))
        kind = pa.int32() if task_type == "classification" else pa.float32()
        fields.append(pa.field(LABEL, kind, nullable=False))
    elif task_type == "token_classification":
        fields += [
            pa.field(TOKENS, pa.list_(pa.string()), nullable=False),
            pa.field(TAGS, pa.list_(pa.int32()), nullable=False),
        ]
    elif task_type == "question_answering":
        fields += [
            pa.field(QUESTION, pa.string(), nullable=False),
            pa.field(CONTEXT, pa.string(), nullable=False),
            pa.field(ANSWER_TEXTS, pa.list_(pa.string()), nullable=False),
            pa.field(ANSWER_STARTS, pa.list_(pa.int32()), nullable=False),
        ]
    elif task_type == "seq2seq":
        fields += [text, pa.field(TARGET, pa.string(), nullable=False)]
    elif task_type == "causal_lm":
        fields += [
            pa.field(PROMPT, pa.string(), nullable=False),
            pa.field(RESPONSE, pa.string(), nullable=False),
        ]
    else:
        raise ValueError(f"unknown task type {task_type!r}; one of {DOWNSTREAM_TASK_TYPES}")
    return pa.schema(fields)


class SchemaError(ValueError):
    """A table lacks a column a core function needs, or has it with the wrong type."""


def require_columns(table: pa.Table, *names: str) -> None:
    """Raise `SchemaError` naming every column of `names` that `table` lacks."""
    missing = [name for name in names if name not in table.column_names]
    if missing:
        raise SchemaError(f"missing column(s) {missing}; table has {table.column_names}")


class ObjectiveMismatchError(ValueError):
    """An objective that cannot be served, by the tokenizer or by the model family.

    The tokenizer lacks a token it needs (T5 sentinels for span corruption), or the model family
    cannot train on it.
    """
