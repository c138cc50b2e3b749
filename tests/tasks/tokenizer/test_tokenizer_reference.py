"""Bring-your-own tokenizers reproduce published reference ids exactly (../shared/data)."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tasks.tokenizer.tokenizer import (
    PretrainedFiles,
    TokenizerConfig,
    load_tokenizer_files,
    to_transformers,
)

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def llama_vectors(folder: Path, out_name: str) -> list[tuple[str, list[int]]]:
    inputs = (folder / "llama_cpp_vocab_test.inp").read_text(encoding="utf-8")
    strings = inputs.split("\n__ggml_vocab_test__\n")[:-1]
    lines = (folder / out_name).read_text(encoding="utf-8").split("\n")[: len(strings)]
    expected = [[int(t) for t in line.split()] for line in lines]
    assert len(strings) == len(expected) == 46
    return list(zip(strings, expected, strict=True))


def bert(vocab_file: Path, **cfg: object) -> Tokenizer:
    config = TokenizerConfig(family="wordpiece", **cfg)  # type: ignore[arg-type]
    return load_tokenizer_files(PretrainedFiles(vocab_txt=str(vocab_file)), config)


@pytest.fixture(scope="module")
def bert_dir(shared_data: Path) -> Path:
    return shared_data / "bert_wordpiece_reference"


@pytest.fixture(scope="module")
def bert_uncased(bert_dir: Path) -> Tokenizer:
    return bert(bert_dir / "bert-base-uncased-vocab.txt")


def test_bert_vocab_reproduces_all_llama_cpp_vectors(
    bert_dir: Path, bert_uncased: Tokenizer
) -> None:
    for text, ids in llama_vectors(bert_dir, "llama_cpp_bert_bge.out"):
        assert bert_uncased.encode(text, add_special_tokens=False).ids == ids, repr(text)


def write_vocab(tmp_path: Path, tokens: list[str]) -> Path:
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path


def test_bert_unit_test_cases_all_pass_through_a_whole_tokenizer(
    bert_dir: Path, bert_uncased: Tokenizer, tmp_path: Path
) -> None:
    """Every case runs on a whole tokenizer. Component cases (BasicTokenizer, Wordpiece-
    Tokenizer) use a vocabulary holding their expected words, so the output is end to end."""
    cases = json.loads((bert_dir / "bert_tokenization_cases.json").read_text())["cases"]
    checked = 0
    for case in cases:
        params, component = case["params"], case["component"]
        lower = params.get("do_lower_case", component.startswith("WordpieceTokenizer") is False)
        options = {
            "lowercase": lower,
            "strip_accents": params.get("strip_accents"),
            "split_chinese_chars": params.get("tokenize_chinese_chars", True),
        }
        vocab = case.get("vocab")
        if vocab == "bert-base-uncased-vocab.txt":
            tok = bert(bert_dir / vocab, **options)
        elif isinstance(vocab, list):
            tok = bert(write_vocab(tmp_path, vocab), **options)
        else:  # BasicTokenizer: the whole tokenizer with the expected words as its vocabulary
            words = [*BERT_SPECIALS, *params.get("never_split", []), *case["expected_tokens"]]
            tok = bert(write_vocab(tmp_path, list(dict.fromkeys(words))), **options)
        if component == "convert_tokens_to_ids":
            assert [tok.token_to_id(t) for t in case["input"]] == case["expected_ids"]
        elif "expected_rule" in case:
            a, b = (tok.encode(x, add_special_tokens=False).ids for x in case["input"])
            assert tok.encode(case["input"][0]).ids == [101, *a, 102]
            assert tok.encode(*case["input"]).ids == [101, *a, 102, *b, 102]
        else:
            special = params.get("add_special_tokens", False)
            encoding = tok.encode(case["input"], add_special_tokens=special)
            assert encoding.tokens == case["expected_tokens"], case["test"]
            if "expected_ids" in case:
                assert encoding.ids == case["expected_ids"], case["test"]
            if "expected_offsets" in case:
                offsets = case["expected_offsets"]
                offsets = json.loads(offsets) if isinstance(offsets, str) else offsets
                assert [list(o) for o in encoding.offsets] == offsets, case["test"]
        checked += 1
    assert checked == len(cases) == 26  # no case excluded


def test_bert_character_classes_behave_as_published(bert_dir: Path, tmp_path: Path) -> None:
    classes = json.loads((bert_dir / "bert_tokenization_cases.json").read_text())[
        "character_classes"
    ]
    tok = bert(
        write_vocab(tmp_path, [*BERT_SPECIALS, "a", "b", "-", "$", "`", "."]), lowercase=False
    )
    for char in classes["is_whitespace"]["true"]:
        assert tok.encode(f"a{char}b", add_special_tokens=False).tokens == ["a", "b"], repr(char)
    for char in classes["is_control"]["true"]:
        assert tok.encode(f"a{char}a", add_special_tokens=False).tokens == ["[UNK]"]  # "aa"
    for char in classes["is_punctuation"]["true"]:
        assert tok.encode(f"a{char}b", add_special_tokens=False).tokens == ["a", char, "b"]


def test_gpt2_files_reproduce_cases_vectors_and_document_count(
    shared_data: Path, gpt2: Tokenizer
) -> None:
    folder = shared_data / "gpt2_bpe_reference"
    reference = json.loads((folder / "gpt2_bpe_cases.json").read_text())
    for case in reference["cases"]:
        if "<|endoftext|>" in case["input"]:
            # lmpipe always treats <|endoftext|> as the special token (tiktoken's allowed_special)
            assert case.get("allowed_special"), case["test"]
        assert gpt2.encode(case["input"]).ids == case["expected_ids"], case["test"]
    assert len(reference["cases"]) == 23
    for text, ids in llama_vectors(folder, "llama_cpp_gpt2.out"):
        assert gpt2.encode(text).ids == ids, repr(text)
    verdict = (folder / "the-verdict.txt").read_text(encoding="utf-8")
    assert len(gpt2.encode(verdict).ids) == reference["the_verdict"]["gpt2_tokens"]


def test_loaded_tokenizers_save_and_reload_with_auto_tokenizer(
    bert_dir: Path, bert_uncased: Tokenizer, gpt2: Tokenizer, tmp_path: Path
) -> None:
    wrapped = to_transformers(bert_uncased, TokenizerConfig(family="wordpiece"))
    wrapped.save_pretrained(tmp_path / "bert")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "bert")
    pair = reloaded("hello world", "second one")
    assert pair["input_ids"] == [101, 7592, 2088, 102, 2117, 2028, 102]
    assert pair["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]
    assert reloaded.mask_token_id == 103
    assert reloaded.pad_token_id == 0
    to_transformers(gpt2, TokenizerConfig(family="bpe", lowercase=False)).save_pretrained(
        tmp_path / "gpt2"
    )
    gpt = AutoTokenizer.from_pretrained(tmp_path / "gpt2")
    assert gpt("hello world")["input_ids"] == [31373, 995]
    assert gpt.eos_token_id == 50256
