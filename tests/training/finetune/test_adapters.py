"""Bottleneck adapters: identity at start, one per sub-layer of every layer, exact save/load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from training.finetune.adapters import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    BottleneckAdapter,
    adapter_sites,
    add_adapters,
    find_adapters,
    load_adapters,
    load_finetuned,
    remove_adapters,
    save_adapters,
)
from training.finetune.strategies import StrategyConfig, apply_strategy
from training.runtime.schedule import GroupLRSchedule

VOCAB = 96
CONFIGS: dict[str, tuple[type[Any], dict[str, Any]]] = {
    "bert": (tf.BertConfig, {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64}),
    "roberta": (
        tf.RobertaConfig,
        {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "pad_token_id": 1},
    ),
    "gpt2": (tf.GPT2Config, {"n_embd": 32, "n_layer": 2, "bos_token_id": 2, "eos_token_id": 2}),
    "llama": (
        tf.LlamaConfig,
        {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64},
    ),
    "t5": (
        tf.T5Config,
        {"d_model": 32, "num_layers": 2, "d_ff": 64, "d_kv": 16, "decoder_start_token_id": 0},
    ),
}
HEADS = {"n_head": 2} | {"num_attention_heads": 2, "num_heads": 2, "num_key_value_heads": 2}


# Tiny matmuls gain nothing from a second thread and crawl when cores are shared.
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(family: str, auto: type[Any] = tf.AutoModelForSequenceClassification) -> Any:
    cls, fields = CONFIGS[family]
    heads = {
        k: v for k, v in HEADS.items() if k in {f.name for f in cls.__dataclass_fields__.values()}
    }
    config = cls(vocab_size=VOCAB, num_labels=2, **{"pad_token_id": 0, **heads, **fields})
    torch.manual_seed(0)
    return auto.from_config(config).eval()


def inputs(seq2seq: bool = False) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))
    ids[:, -1] = 1  # eos for T5's classification pooling (T5Config eos_token_id=1)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return batch | {"decoder_input_ids": ids} if seq2seq else batch


def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(**batch).logits
    return out


@pytest.mark.parametrize("family", list(CONFIGS))
def test_fresh_adapters_leave_the_model_output_unchanged(family: str) -> None:
    model = tiny(family)
    before = logits(model, inputs())
    added = add_adapters(model, AdapterConfig())
    assert added
    assert torch.equal(logits(model, inputs()), before)


@pytest.mark.parametrize(
    ("family", "root", "attention", "ffn"),
    [
        ("bert", "bert.encoder.layer", "attention.output.dense", "output.dense"),
        ("roberta", "roberta.encoder.layer", "attention.output.dense", "output.dense"),
        ("gpt2", "transformer.h", "attn.c_proj", "mlp.c_proj"),
        ("llama", "model.layers", "self_attn.o_proj", "mlp.down_proj"),
    ],
)
def test_adapters_sit_after_attention_and_ffn_of_every_layer(
    family: str, root: str, attention: str, ffn: str
) -> None:
    expected = [f"{root}.{i}.{site}" for i in range(2) for site in (attention, ffn)]
    assert adapter_sites(tiny(family), "both") == expected
    assert adapter_sites(tiny(family), "ffn") == expected[1::2]


def test_t5_adapters_cover_self_cross_attention_and_ffn_of_every_block() -> None:
    sites = adapter_sites(tiny("t5", tf.AutoModelForSeq2SeqLM), "both")
    # 2 encoder blocks x (self-attention, FFN) + 2 decoder blocks x (self, cross, FFN)
    assert len(sites) == 2 * 2 + 2 * 3
    assert sum(".EncDecAttention.o" in s for s in sites) == 2
    assert adapter_sites(tiny("t5", tf.AutoModelForSeq2SeqLM), "ffn") == [
        s for s in sites if s.endswith(".wo")
    ]


def test_adapter_width_follows_reduction_factor_or_explicit_bottleneck() -> None:
    model = tiny("bert")
    added = add_adapters(model, AdapterConfig(reduction_factor=8, placement="ffn"))
    assert {a.down.out_features for a in added.values()} == {4}  # 32 // 8
    remove_adapters(model)
    added = add_adapters(model, AdapterConfig(bottleneck=5, placement="attention"))
    assert {a.down.out_features for a in added.values()} == {5}


def test_adapters_refuse_an_unsupported_family() -> None:
    config = tf.MPNetConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    model = tf.MPNetForSequenceClassification(config)  # not a family of the model table
    with pytest.raises(ValueError, match="mpnet"):
        add_adapters(model, AdapterConfig())


def test_mixtral_adapters_go_on_attention_only() -> None:
    config = tf.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_local_experts=2,
    )
    model = tf.MixtralForSequenceClassification(config)
    with pytest.raises(ValueError, match=r"mixture of experts\); use adapter placement attention"):
        add_adapters(model, AdapterConfig())
    assert adapter_sites(model, "attention") == [
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
    ]


def test_remove_adapters_restores_the_plain_model() -> None:
    model = tiny("gpt2")
    names = {n for n, _ in model.named_parameters()}
    add_adapters(model, AdapterConfig())
    with torch.no_grad():
        for adapter in find_adapters(model).values():
            adapter.up.bias.fill_(0.5)  # no longer the identity
    removed = remove_adapters(model)
    assert removed
    assert all(isinstance(a, BottleneckAdapter) for a in removed.values())
    assert {n for n, _ in model.named_parameters()} == names
    assert find_adapters(model) == {}
    fresh = tiny("gpt2")
    assert torch.equal(logits(model, inputs()), logits(fresh, inputs()))


@pytest.mark.parametrize(
    ("family", "auto", "task_type"),
    [
        ("bert", tf.AutoModelForSequenceClassification, "classification"),
        ("gpt2", tf.AutoModelForCausalLM, "causal_lm"),
        ("t5", tf.AutoModelForSeq2SeqLM, "seq2seq"),
    ],
)
def test_adapter_export_round_trip_gives_identical_logits(
    family: str, auto: type[Any], task_type: str, tmp_path: Path
) -> None:
    model = tiny(family, auto)
    heads = ["classifier"] if family == "bert" else ["lm_head"]
    plan = apply_strategy(model, StrategyConfig(name="adapters"), heads)
    batch = inputs(seq2seq=family == "t5")
    labels = batch["input_ids"] if family != "bert" else torch.tensor([0, 1, 1])
    optimizer = torch.optim.AdamW(plan.param_groups(1e-2, weight_decay=0.0))
    schedule = GroupLRSchedule(optimizer, warmup_steps=0, total_steps=3)
    for _ in range(3):
        plan.model.train()
        plan.model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    expected = logits(plan.model, batch)

    files = plan.save_export(tmp_path)
    plain = auto.from_pretrained(tmp_path / "base_model")
    restored = load_finetuned(tmp_path, task_type)

    assert {CONFIG_FILE, WEIGHTS_FILE} <= {f.name for f in files}
    assert not torch.equal(logits(plain, batch), expected)  # the adapters matter
    assert torch.equal(logits(restored, batch), expected)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model = tiny("bert")
    added = add_adapters(model, AdapterConfig(placement="ffn"))
    save_adapters(added, AdapterConfig(placement="ffn"), tmp_path)
    return tmp_path


def test_load_adapters_names_a_site_the_model_lacks(saved: Path) -> None:
    meta = json.loads((saved / CONFIG_FILE).read_text())
    meta["sites"][0] = "bert.encoder.layer.9.output.dense"
    (saved / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"adapters\.json: site 'bert\.encoder\.layer\.9"):
        load_adapters(tiny("bert"), saved)


def test_load_adapters_names_the_file_and_a_missing_tensor(saved: Path) -> None:
    tensors = load_file(str(saved / WEIGHTS_FILE))
    tensors.pop("bert.encoder.layer.1.output.dense.bottleneck_adapter.up.bias")
    save_file(tensors, str(saved / WEIGHTS_FILE))
    model = tiny("bert")
    with pytest.raises(ValueError, match=r"adapters\.safetensors: missing tensors .*layer\.1"):
        load_adapters(model, saved)
    assert find_adapters(model) == {}  # nothing half-attached


def test_load_adapters_names_a_bad_config_key(saved: Path) -> None:
    meta = json.loads((saved / CONFIG_FILE).read_text())
    meta["config"]["placement"] = "everywhere"
    (saved / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"adapters\.json: key 'config'"):
        load_adapters(tiny("bert"), saved)
