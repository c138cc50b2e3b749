"""Unigram trained with sentencepiece and converted: encodes like the sentencepiece model."""

import re
from pathlib import Path

import pytest
import sentencepiece as spm

from tasks.tokenizer.tokenizer import (
    PretrainedFiles,
    TokenizerConfig,
    from_sentencepiece,
    load_tokenizer_files,
    train_sentencepiece,
)

pytestmark = pytest.mark.slow

# Float rounding: sentencepiece sums float32 scores, `tokenizers` float64.
TIE = 1e-3


def corpora(shared_data: Path) -> dict[str, list[str]]:
    """Every pretraining text in ../shared/data, as raw blocks and as single lines."""
    blocks = []
    for book in sorted((shared_data / "gutenberg_books").glob("*.txt")):
        text = book.read_text(encoding="utf-8-sig")
        blocks += [b for b in re.split(r"\r?\n\s*\r?\n", text) if b.strip()]
    shakespeare = (shared_data / "tiny_shakespeare" / "input.txt").read_text(encoding="utf-8")
    return {
        "gutenberg blocks (raw, CRLF, wrapped)": blocks,
        "gutenberg lines": [line for b in blocks for line in b.splitlines()],
        "tiny shakespeare lines": shakespeare.splitlines(),
        "bert sample text": (shared_data / "bert_sample_text" / "sample_text.txt")
        .read_text(encoding="utf-8")
        .splitlines(),
    }


@pytest.fixture(scope="module")
def model(shared_data: Path) -> tuple[bytes, TokenizerConfig]:
    """A 4,000-piece T5-style model trained by sentencepiece on the Gutenberg books."""
    cfg = TokenizerConfig(family="unigram", vocab_size=4000, lowercase=False)
    docs = corpora(shared_data)["gutenberg blocks (raw, CRLF, wrapped)"]
    return train_sentencepiece(iter(docs), cfg), cfg


def path_score(processor: spm.SentencePieceProcessor, ids: list[int]) -> float:
    return sum(processor.get_score(i) for i in ids)


def test_converted_tokenizer_encodes_every_real_text_like_sentencepiece(
    shared_data: Path, model: tuple[bytes, TokenizerConfig]
) -> None:
    """Identical ids on every text, except exact ties between two best segmentations.

    A run like '-----' has several segmentations whose scores are equal up to float rounding
    ('--' '-' '--' vs '-' '--' '--'); the two libraries break such ties differently. Each
    difference must be such a tie (same length, same total score), and they must be rare.
    """
    blob, cfg = model
    processor = spm.SentencePieceProcessor(model_proto=blob)
    tok = from_sentencepiece(blob, cfg)
    for name, texts in corpora(shared_data).items():
        ours = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        theirs = processor.encode(texts)
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
        for i in differ:
            a, b = ours[i], theirs[i]
            assert len(a) == len(b), (name, texts[i][:80], a, b)
            assert abs(path_score(processor, a) - path_score(processor, b)) < TIE, texts[i][:80]
            assert processor.decode(a) == processor.decode(b)
        assert len(differ) <= len(texts) // 1000, (name, len(differ), len(texts))
        assert sum(map(len, ours)) > 0


def test_converted_tokenizer_has_t5_layout(model: tuple[bytes, TokenizerConfig]) -> None:
    blob, cfg = model
    tok = from_sentencepiece(blob, cfg)
    size = tok.get_vocab_size()
    assert [tok.id_to_token(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    assert tok.token_to_id("<extra_id_0>") == size - 1 == 3999
    assert tok.token_to_id("<extra_id_99>") == size - 100
    assert tok.encode("a b", add_special_tokens=True).tokens[-1] == "</s>"
    # Specials inside text are kept whole, as T5's span-corrupted inputs need.
    assert "<extra_id_0>" in tok.encode("x <extra_id_0> y").tokens


def test_bring_your_own_spm_model(tmp_path: Path, model: tuple[bytes, TokenizerConfig]) -> None:
    blob, cfg = model
    (tmp_path / "spiece.model").write_bytes(blob)
    tok = load_tokenizer_files(PretrainedFiles(spm_model=str(tmp_path / "spiece.model")), cfg)
    processor = spm.SentencePieceProcessor(model_proto=blob)
    text = "It was the best of times, it was the worst of times."
    assert tok.encode(text, add_special_tokens=False).ids == processor.encode(text)


def test_non_unigram_spm_model_is_refused(shared_data: Path) -> None:
    import io

    docs = corpora(shared_data)["tiny shakespeare lines"][:3000]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs),
        model_writer=model,
        model_type="bpe",
        vocab_size=500,
        minloglevel=2,
    )
    with pytest.raises(ValueError, match="not a Unigram model"):
        from_sentencepiece(model.getvalue(), TokenizerConfig(family="unigram"))
