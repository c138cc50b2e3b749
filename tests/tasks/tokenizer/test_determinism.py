"""Tokenizer training gives the same bytes in every process: the acceptance of deterministic
training, one family per test, 5 fresh processes each (hash seeds and Rayon thread counts vary).

The corpus is built to make upstream's WordPiece trainer diverge: many distinct continuation
characters and words with tied pair counts. `test_upstream_wordpiece_diverges_on_this_corpus`
shows it does, so a pass of the others is not luck. The char family trains on it plus rare
characters that tie, cut through by `vocab_size`, so the tie-break is what is tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.tokenizer.tokenizer import TokenizerConfig, to_transformers, train_tokenizer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
PROCESSES = 5
ALPHABET = "abcdefghijklmnopqrstuvwxyzþðæøåß0123456789"


def corpus() -> list[str]:
    """About 2,000 documents of random words over 42 characters (seeded: the same every call)."""
    draw = random.Random(7)
    words = ["".join(draw.choice(ALPHABET) for _ in range(draw.randint(2, 9))) for _ in range(3000)]
    return [" ".join(draw.choice(words) for _ in range(40)) for _ in range(2000)]


def char_corpus() -> list[str]:
    """`corpus()` twice, with 300 Cyrillic characters seen twice each in shuffled documents.

    With `CHAR_CONFIG` the 43 characters of the corpus and the 2 specials leave 155 places for
    the 300 tied ones: which of them make it depends on the tie-break alone.
    """
    rare = [chr(c) for c in range(0x400, 0x400 + 300)]
    random.Random(11).shuffle(rare)
    return [*corpus(), *("".join(rare[k : k + 30]) for k in range(0, 300, 30))] * 2


# Run in a fresh interpreter: trains with the config given as JSON on argv, prints the sha256
# of the tokenizer.json that the tokenizer stage would save.
TRAIN = """
import hashlib, json, sys, tempfile
from pathlib import Path
from tests.tasks.tokenizer.test_determinism import corpus, saved_tokenizer_json
from tasks.tokenizer.tokenizer import TokenizerConfig
cfg = TokenizerConfig.model_validate_json(sys.argv[1])
print(hashlib.sha256(saved_tokenizer_json(corpus(), cfg)).hexdigest())
"""
CHAR_CONFIG = {"family": "char", "vocab_size": 200, "min_frequency": 1}
CHAR_TRAIN = """
import hashlib, sys
from tests.tasks.tokenizer.test_determinism import char_corpus, saved_tokenizer_json
from tasks.tokenizer.tokenizer import TokenizerConfig
cfg = TokenizerConfig.model_validate_json(sys.argv[1])
print(hashlib.sha256(saved_tokenizer_json(char_corpus(), cfg)).hexdigest())
"""
# Upstream's WordPiece trainer as the project called it before deterministic training.
UPSTREAM = """
import hashlib
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from tests.tasks.tokenizer.test_determinism import corpus
tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
tok.normalizer = normalizers.BertNormalizer(lowercase=True)
tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
trainer = trainers.WordPieceTrainer(
    vocab_size=2000, min_frequency=2, continuing_subword_prefix="##", show_progress=False,
    special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
)
tok.train_from_iterator(corpus(), trainer=trainer)
print(hashlib.sha256(tok.to_str().encode()).hexdigest())
"""


def saved_tokenizer_json(texts: list[str], cfg: TokenizerConfig) -> bytes:
    """Train on `texts` and return `tokenizer.json` as the tokenizer stage saves it."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        to_transformers(train_tokenizer(texts, cfg), cfg).save_pretrained(out)
        return (Path(out) / "tokenizer.json").read_bytes()


def digests(script: str, *args: str, threads: int | None = None) -> set[str]:
    """The digest `script` prints in each of 5 fresh processes, hash seed and threads varied.

    With `threads`, every process runs that many Rayon threads.
    """
    found = set()
    for k in range(PROCESSES):
        env = os.environ | {
            "PYTHONHASHSEED": str(11 * k + 3),
            "RAYON_NUM_THREADS": str(threads or 1 + k % 2),
            "PYTHONPATH": str(ROOT),
        }
        done = subprocess.run(
            [sys.executable, "-c", script, *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        found.add(done.stdout.strip().splitlines()[-1])
    return found


def test_upstream_wordpiece_diverges_on_this_corpus() -> None:
    assert len(digests(UPSTREAM)) > 1


@pytest.mark.parametrize(
    "config",
    [
        {"family": "wordpiece", "vocab_size": 2000},
        {"family": "bpe", "vocab_size": 2000},
        {"family": "bpe", "bpe_style": "roberta", "vocab_size": 2000},
        {"family": "unigram", "vocab_size": 1000},
    ],
    ids=["wordpiece", "bpe-gpt2", "bpe-roberta", "unigram-sentencepiece"],
)
def test_training_gives_the_same_tokenizer_json_in_every_process(config: dict[str, object]) -> None:
    assert len(digests(TRAIN, json.dumps(config))) == 1


def test_char_training_breaks_ties_the_same_way_in_every_process() -> None:
    cfg = TokenizerConfig.model_validate(CHAR_CONFIG)
    vocab = json.loads(saved_tokenizer_json(char_corpus(), cfg))["model"]["vocab"]
    rare = sorted(t for t in vocab if len(t) == 1 and 0x400 <= ord(t) < 0x400 + 300)
    assert len(vocab) == 200
    assert rare == [chr(c) for c in range(0x400, 0x400 + 155)]  # the tie kept in code-point order
    assert len(digests(CHAR_TRAIN, json.dumps(CHAR_CONFIG))) == 1


def test_wordpiece_continuations_are_vocabulary_not_added_tokens() -> None:
    cfg = TokenizerConfig(family="wordpiece", vocab_size=2000)
    state = json.loads(saved_tokenizer_json(corpus()[:300], cfg))
    added = {t["content"] for t in state["added_tokens"]}
    assert added == {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    vocab = state["model"]["vocab"]
    continuations = sorted(t for t in vocab if len(t) == 3 and t.startswith("##"))
    # Right after the specials, in code-point order.
    assert [vocab[t] for t in continuations] == list(range(5, 5 + len(continuations)))
    tok = train_tokenizer(corpus()[:300], cfg)
    assert tok.encode("##a").tokens != ["##a"]  # literal text is never an added token


def test_a_tokenizer_trained_before_still_loads(tmp_path: Path) -> None:
    from tasks.tokenizer.tokenizer import PretrainedFiles, load_tokenizer_files

    script = UPSTREAM.replace("print(hashlib.sha256(tok.to_str().encode()).hexdigest())", "")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    path = tmp_path / "tokenizer.json"
    subprocess.run(
        [sys.executable, "-c", script + f"\ntok.save({str(path)!r})"],
        env=env,
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    cfg = TokenizerConfig(family="wordpiece", pretrained=PretrainedFiles(tokenizer_json=str(path)))
    tok = load_tokenizer_files(cfg.pretrained, cfg)  # type: ignore[arg-type]
    assert tok.encode("abc").ids
    assert hashlib.sha256(tok.to_str().encode()).digest()


def test_the_scan_finds_exactly_the_trainers_continuation_pieces() -> None:
    from tokenizers import trainers as tk_trainers

    from tasks.tokenizer.tokenizer import untrained_tokenizer
    from tasks.tokenizer.wordpiece import continuation_pieces

    texts = [
        *corpus()[:200],
        "Ça déjà vu, NAÏVE façade; 東京は大きい都市です。 x\x01y tab\tword",
        "Ελληνικά ΣΟΦΙΑ Straße — dash-joined (paren) «quote» ½ ²³ ﬁnance",
        "ab\u0301c q\u200bz emoji🙂s \U0001d518\U0001d52b\U0001d526",
    ]
    for lowercase in (True, False):
        cfg = TokenizerConfig(family="wordpiece", vocab_size=2000, lowercase=lowercase)
        tok = untrained_tokenizer(cfg)
        trainer = tk_trainers.WordPieceTrainer(
            vocab_size=1, continuing_subword_prefix="##", show_progress=False
        )
        tok.train_from_iterator(texts, trainer=trainer)
        made = sorted(t for t in tok.get_vocab() if t.startswith("##"))
        assert continuation_pieces(texts, tok.normalizer) == made
