"""Task models loaded from tiny saved pretraining models of every family, and their random twins."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from tasks.common.schema import downstream_schema
from tasks.tokenizer.tokenizer import (
    TokenizerConfig,
    padded_vocab_size,
    to_transformers,
    train_tokenizer,
)
from training.finetune.features.features import FeatureConfig, featurize, make_collator
from training.models.export import UnsafeWeightsError
from training.models.models import FAMILIES, OBJECTIVES, ModelConfig, auto_class, build_model
from training.models.task_models import (
    HEAD_MODULES,
    SUPPORTED_TASKS,
    TaskModelError,
    TaskSpec,
    load_task_model,
)

TOKENIZERS = {
    "bert": TokenizerConfig(family="wordpiece", vocab_size=200, min_frequency=1),
    "roberta": TokenizerConfig(family="bpe", bpe_style="roberta", vocab_size=300, min_frequency=1),
    "gpt2": TokenizerConfig(family="bpe", vocab_size=300, min_frequency=1),
    "llama": TokenizerConfig(family="bpe", vocab_size=300, min_frequency=1),
    "t5": TokenizerConfig(family="unigram", vocab_size=200, extra_ids=4, min_frequency=1),
}
# The rest of the model table: WordPiece for the BERT descendants, RoBERTa-style BPE for the
# other encoders and BART, GPT-2-style BPE for the decoders; tiny presets, no overrides.
TOKENIZERS |= {
    family: TOKENIZERS[
        "bert"
        if family in ("albert", "distilbert", "electra")
        else "gpt2"
        if spec.kind == "decoder"
        else "roberta"
    ]
    for family, spec in FAMILIES.items()
    if family not in TOKENIZERS
}
ENCODER = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
OVERRIDES: dict[str, dict[str, int | float | str | bool]] = {
    "bert": {**ENCODER, "max_position_embeddings": 64},
    "roberta": {**ENCODER, "max_position_embeddings": 66},
    "gpt2": {"n_embd": 32, "n_head": 2, "n_inner": 64, "n_positions": 64},
    "llama": {**ENCODER, "num_key_value_heads": 2, "max_position_embeddings": 64},
    "t5": {"d_model": 32, "num_heads": 2, "d_ff": 64, "d_kv": 16},
}
OBJECTIVE = {family: objectives[0] for family, objectives in OBJECTIVES.items()}
SPECS = {
    "classification": TaskSpec(task_type="classification", labels=("neg", "pos", "mixed")),
    "regression": TaskSpec(task_type="regression"),
    "token_classification": TaskSpec(task_type="token_classification", labels=("O", "B-X", "I-X")),
    "question_answering": TaskSpec(task_type="question_answering"),
    "seq2seq": TaskSpec(task_type="seq2seq"),
    "causal_lm": TaskSpec(task_type="causal_lm"),
}
PAIRS = [(family, task) for family, tasks in SUPPORTED_TASKS.items() for task in tasks]


def sentences(n: int = 200) -> list[str]:
    rng = random.Random(0)
    words = [a + b for a in ("ka", "lo", "mi", "ran", "te", "sul") for b in ("vo", "ni", "pe")]
    return [" ".join(rng.choices(words, k=rng.randint(3, 9))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per family: a directory with a tiny seeded pretraining model and its tokenizer."""
    dirs = {}
    for family, tok_cfg in TOKENIZERS.items():
        backend = train_tokenizer(sentences(), tok_cfg)
        tok = to_transformers(backend, tok_cfg)
        ids = {
            "pad": tok.pad_token_id,
            "eos": tok.eos_token_id,
            "cls": tok.cls_token_id,
            "sep": tok.sep_token_id,
            "mask": tok.mask_token_id,
        }
        torch.manual_seed(0)
        model = build_model(
            ModelConfig(family=family, overrides=OVERRIDES.get(family, {})),  # type: ignore[arg-type]
            OBJECTIVE[family],
            padded_vocab_size(backend, tok_cfg),
            {**ids, "vocab_size": len(tok)},
            32,
        )
        dirs[family] = tmp_path_factory.mktemp(family)
        model.save_pretrained(dirs[family])
        tok.save_pretrained(dirs[family])
    return dirs


def source_tensor(name: str, weights: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The saved tensor a task-model parameter should come from (body renames included)."""
    rest = name.split(".", 1)[1] if "." in name else name
    for candidate in (name, rest, "model." + rest):  # T5 body in `transformer.`; llama QA
        if candidate in weights:
            return weights[candidate]
    return None


@pytest.mark.parametrize(("family", "task"), PAIRS)
def test_pretrained_body_loads_exactly_and_only_the_head_is_new(
    saved: dict[str, Path], family: str, task: str
) -> None:
    model = load_task_model(saved[family], SPECS[task], seed=3)
    # The saved model as transformers loads it: names as the modules hold them (Mixtral's
    # fused experts are stored per expert on disk).
    weights = auto_class(family).from_pretrained(saved[family]).state_dict()  # type: ignore[arg-type]
    new = []
    for name, param in model.named_parameters():
        source = source_tensor(name, weights)
        if source is None:
            new.append(name)
        else:
            assert torch.equal(param.detach(), source), name
    assert all(name.split(".", 1)[0] in HEAD_MODULES for name in new), new
    assert bool(new) == (task not in ("seq2seq", "causal_lm"))
    assert not model.training


@pytest.mark.parametrize(
    ("family", "task"),
    [
        ("bert", "classification"),
        ("gpt2", "causal_lm"),
        ("t5", "seq2seq"),
        ("llama", "question_answering"),
    ],
)
def test_random_init_twin_has_the_same_architecture_and_fresh_weights(
    saved: dict[str, Path], family: str, task: str
) -> None:
    pretrained = load_task_model(saved[family], SPECS[task], seed=0)
    # seed 1: the saved model was itself initialised from seed 0
    twin = load_task_model(saved[family], SPECS[task], random_init=True, seed=1)
    assert type(twin) is type(pretrained)
    shapes = [(n, p.shape) for n, p in pretrained.named_parameters()]
    assert [(n, p.shape) for n, p in twin.named_parameters()] == shapes
    matrices = [
        (a, b)
        for (_, a), (_, b) in zip(
            pretrained.named_parameters(), twin.named_parameters(), strict=True
        )
        if a.ndim == 2
    ]
    assert matrices
    assert not any(torch.equal(a, b) for a, b in matrices)
    again = load_task_model(saved[family], SPECS[task], random_init=True, seed=1)
    assert all(
        torch.equal(a, b) for a, b in zip(twin.parameters(), again.parameters(), strict=True)
    )


def test_head_initialisation_is_seeded_and_leaves_the_global_rng_alone(
    saved: dict[str, Path],
) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = load_task_model(saved["bert"], SPECS["classification"], seed=7).classifier.weight
    assert torch.equal(torch.rand(1), expected_next)
    second = load_task_model(saved["bert"], SPECS["classification"], seed=7).classifier.weight
    other = load_task_model(saved["bert"], SPECS["classification"], seed=8).classifier.weight
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_labels_and_problem_type_reach_the_model_config(saved: dict[str, Path]) -> None:
    model = load_task_model(saved["gpt2"], SPECS["classification"])
    assert model.config.id2label == {0: "neg", 1: "pos", 2: "mixed"}
    assert model.config.label2id["mixed"] == 2
    assert model.config.problem_type == "single_label_classification"
    assert model.config.pad_token_id == model.config.eos_token_id  # GPT-2 has no pad token
    regression = load_task_model(saved["roberta"], SPECS["regression"])
    assert (regression.config.problem_type, regression.config.num_labels) == ("regression", 1)


@pytest.mark.parametrize(
    ("family", "task", "hint"),
    [
        ("bert", "seq2seq", "use a t5 or bart model"),
        ("roberta", "causal_lm", "use a gpt2, llama, mistral or mixtral model"),
        ("bart", "causal_lm", "write the data as seq2seq"),
        ("gpt2", "seq2seq", "write the data as causal_lm"),
        ("t5", "causal_lm", "write the data as seq2seq"),
    ],
)
def test_unsupported_pairs_are_refused_with_what_to_do_instead(
    saved: dict[str, Path], family: str, task: str, hint: str
) -> None:
    with pytest.raises(
        TaskModelError, match=rf"{family} model cannot be fine-tuned for {task}.*{hint}"
    ):
        load_task_model(saved[family], SPECS[task])


def test_a_family_other_than_the_task_expects_is_refused(saved: dict[str, Path]) -> None:
    spec = TaskSpec(task_type="regression", family="bert")
    with pytest.raises(TaskModelError, match="holds a gpt2 model, the task expects bert"):
        load_task_model(saved["gpt2"], spec)


def test_task_spec_needs_labels_exactly_where_the_task_has_classes() -> None:
    with pytest.raises(ValueError, match="at least 2 labels"):
        TaskSpec(task_type="classification", labels=("only",))
    with pytest.raises(ValueError, match="takes no labels"):
        TaskSpec(task_type="seq2seq", labels=("a", "b"))
    assert TaskSpec(task_type="question_answering").num_labels == 2


def test_pickle_only_or_empty_directories_are_refused(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_bytes((saved["bert"] / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_task_model(tmp_path, SPECS["classification"])
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(UnsafeWeightsError, match=r"pytorch_model\.bin"):
        load_task_model(tmp_path, SPECS["classification"])


def test_a_missing_body_weight_is_refused_by_name(saved: dict[str, Path], tmp_path: Path) -> None:
    weights = load_file(saved["bert"] / "model.safetensors")
    del weights["bert.encoder.layer.1.output.dense.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_bytes((saved["bert"] / "config.json").read_bytes())
    with pytest.raises(TaskModelError, match=r"layer\.1\.output\.dense\.weight"):
        load_task_model(tmp_path, SPECS["classification"])


def batch_for(family: str, task: str, saved: dict[str, Path]) -> dict[str, torch.Tensor]:
    tok = tf.AutoTokenizer.from_pretrained(saved[family])
    texts = sentences(4)
    ids = ["a", "b", "c", "d"]
    columns: dict[str, list] = {
        "classification": {"text": texts, "label": [0, 2, 1, 0]},
        "seq2seq": {"text": texts, "target": texts[::-1]},
        "causal_lm": {"prompt": texts, "response": texts[::-1]},
        "token_classification": {
            "tokens": [t.split() for t in texts],
            "tags": [[1] + [2] * (len(t.split()) - 1) for t in texts],
        },
        "question_answering": {
            "question": ["what?"] * 4,
            "context": texts,
            "answer_texts": [[t.split()[1]] for t in texts],
            "answer_starts": [[len(t.split()[0]) + 1] for t in texts],
        },
    }[task]
    table = pa.table({"example_id": ids, **columns}, schema=downstream_schema(task))
    labels = SPECS[task].labels
    features = featurize(table, tok, task, FeatureConfig(max_length=24, stride=4), labels)
    return make_collator(task, tok)([features[i] for i in range(len(features))])


@pytest.mark.parametrize(
    ("family", "task"),
    [
        ("bert", "token_classification"),
        ("roberta", "question_answering"),
        ("gpt2", "classification"),
        ("gpt2", "causal_lm"),
        ("llama", "question_answering"),
        ("t5", "classification"),
        ("t5", "seq2seq"),
    ],
)
def test_collated_features_train_each_task_model(
    saved: dict[str, Path], family: str, task: str
) -> None:
    model = load_task_model(saved[family], SPECS[task])
    batch = batch_for(family, task, saved)
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_gpt2_classifier_reads_the_last_real_token_of_a_right_padded_row(
    saved: dict[str, Path],
) -> None:
    model = load_task_model(saved["gpt2"], SPECS["classification"])
    batch = batch_for("gpt2", "classification", saved)
    assert (batch["attention_mask"] == 0).any()  # rows of different lengths
    padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for i, mask in enumerate(batch["attention_mask"]):
        alone = batch["input_ids"][i : i + 1, : int(mask.sum())]
        np.testing.assert_allclose(
            model(input_ids=alone).logits[0].detach(), padded[i].detach(), rtol=1e-5, atol=1e-6
        )
