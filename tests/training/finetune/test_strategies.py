"""Transfer strategies on tiny random models: each changes exactly the parameters it promises."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from pydantic import ValidationError

from training.finetune.adapters import load_finetuned
from training.finetune.strategies import (
    StrategyConfig,
    StrategyPlan,
    apply_strategy,
    head_prefixes_for,
    layer_index,
)
from training.runtime.schedule import GroupLRSchedule

VOCAB, SEQ, BATCH = 96, 12, 4


# Tiny matmuls gain nothing from a second thread and crawl when cores are shared.
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(family: str, **extra: Any) -> tf.PreTrainedConfig:
    """A 2-layer, width-32 config of `family` (T5: 2 encoder + 2 decoder blocks)."""
    fields: dict[str, Any] = {"vocab_size": VOCAB, "pad_token_id": 0, "num_labels": 3}
    if family in ("bert", "roberta", "llama"):
        fields |= {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
        fields |= {"intermediate_size": 64, "max_position_embeddings": 64}
    if family == "roberta":
        fields |= {"pad_token_id": 1, "max_position_embeddings": 66}
    if family == "llama":
        fields |= {"num_key_value_heads": 2}
    if family == "gpt2":
        fields |= {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}
        fields |= {"bos_token_id": 2, "eos_token_id": 2}
    if family == "t5":
        fields |= {"d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "d_kv": 16}
        fields |= {"eos_token_id": 2, "decoder_start_token_id": 0}
    classes = {"bert": tf.BertConfig, "roberta": tf.RobertaConfig, "gpt2": tf.GPT2Config}
    classes |= {"llama": tf.LlamaConfig, "t5": tf.T5Config}
    return classes[family](**fields | extra)


def tiny_model(family: str, auto: type[Any], seed: int = 0) -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    return auto.from_config(tiny_config(family))


def batch_for(model: tf.PreTrainedModel, seed: int = 1) -> dict[str, torch.Tensor]:
    """A random batch with the labels the model's task class takes."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    ids[:, -1] = 2  # an eos: T5 classification pools at it
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        batch["labels"] = torch.randint(0, 3, (BATCH,), generator=gen)
    elif name.endswith("ForTokenClassification"):
        batch["labels"] = torch.randint(0, 3, (BATCH, SEQ), generator=gen)
    else:  # language modelling: predict the input
        batch["labels"] = ids
    return batch


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed_names(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def train_steps(plan: StrategyPlan, batch: dict[str, torch.Tensor], steps: int = 3) -> None:
    """`steps` AdamW steps with weight decay (which would move any parameter given an lr)."""
    optimizer = torch.optim.AdamW(plan.param_groups(1e-2, weight_decay=0.1))
    schedule = GroupLRSchedule(optimizer, warmup_steps=1, total_steps=10)
    plan.model.train()
    for _ in range(steps):
        plan.model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()


def logits_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(**batch).logits
    return out


# --- config composition ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "section",
    [
        {"name": "full", "layer_decay": 0.8},
        {"name": "progressive_unfreezing", "layer_decay": 0.9, "unfreeze_every_epochs": 2},
        {"name": "lora", "head_lr_mult": 10, "lora": {"r": 4}},
        {"name": "adapters", "head_lr_mult": 5, "adapter": {"placement": "ffn"}},
        {"name": "prompt_tuning", "prompt": {"num_virtual_tokens": 4}},
    ],
)
def test_strategy_config_accepts_natural_compositions(section: dict[str, Any]) -> None:
    assert StrategyConfig.model_validate(section).name == section["name"]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"name": "lora", "layer_decay": 0.8}, "layer_decay"),
        ({"name": "feature_extraction", "head_lr_mult": 10}, "head_lr_mult"),
        ({"name": "full", "lora": {"r": 4}}, "strategy.lora only applies to name: lora"),
        ({"name": "full", "unfreeze_every_epochs": 2}, "unfreeze_every_epochs"),
        ({"name": "lora", "adapter": {"reduction_factor": 4}}, "strategy.adapter only applies"),
        ({"name": "ful"}, "name"),
        ({"name": "full", "layer_decay": 1.5}, "layer_decay"),
        ({"name": "full", "lr_mult": 2}, "lr_mult"),
    ],
)
def test_strategy_config_refuses_invalid_combinations(
    section: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        StrategyConfig.model_validate(section)


# --- heads and depths ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "auto", "heads"),
    [
        ("bert", tf.AutoModelForSequenceClassification, ("classifier",)),
        ("bert", tf.AutoModelForQuestionAnswering, ("qa_outputs",)),
        ("roberta", tf.AutoModelForSequenceClassification, ("classifier",)),
        ("gpt2", tf.AutoModelForSequenceClassification, ("score",)),
        ("gpt2", tf.AutoModelForCausalLM, ("lm_head",)),
        ("llama", tf.AutoModelForTokenClassification, ("score",)),
        ("t5", tf.AutoModelForSequenceClassification, ("classification_head",)),
        ("t5", tf.AutoModelForSeq2SeqLM, ("lm_head",)),
    ],
)
def test_head_prefixes_for_finds_the_task_head(
    family: str, auto: type[Any], heads: tuple[str, ...]
) -> None:
    assert head_prefixes_for(tiny_model(family, auto)) == heads


def test_head_prefixes_for_refuses_a_headless_model() -> None:
    with pytest.raises(ValueError, match="no known task head"):
        head_prefixes_for(tf.BertModel(tiny_config("bert")))


@pytest.mark.parametrize(
    ("name", "depth"),
    [
        ("bert.embeddings.word_embeddings.weight", 0),
        ("bert.encoder.layer.0.attention.self.query.weight", 1),
        ("bert.encoder.layer.3.output.LayerNorm.bias", 4),
        ("bert.pooler.dense.weight", 4),
        ("transformer.wpe.weight", 0),
        ("transformer.h.2.mlp.c_fc.weight", 3),
        ("transformer.ln_f.weight", 4),
        ("model.layers.1.self_attn.q_proj.weight", 2),
        ("model.norm.weight", 4),
        ("shared.weight", 0),
        ("encoder.block.1.layer.1.DenseReluDense.wo.weight", 2),
        ("encoder.final_layer_norm.weight", 2),
        ("decoder.block.0.layer.1.EncDecAttention.q.weight", 3),
        ("decoder.final_layer_norm.weight", 4),
    ],
)
def test_layer_index_numbers_embeddings_layers_and_top(name: str, depth: int) -> None:
    # T5 rows: 2 encoder + 2 decoder blocks stacked (L = 4, E = 2); others: L = 4.
    assert layer_index(name, num_layers=4, encoder_layers=2 if "coder" in name else None) == depth


@pytest.mark.parametrize("name", ["classifier.weight", "bert.encoder.layer.7.output.dense.bias"])
def test_layer_index_refuses_unplaceable_names(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        layer_index(name, num_layers=4)


def test_apply_strategy_refuses_a_head_prefix_that_names_nothing() -> None:
    model = tiny_model("bert", tf.AutoModelForSequenceClassification)
    with pytest.raises(ValueError, match="'head' names no parameter"):
        apply_strategy(model, StrategyConfig(), ["head"])


# --- acceptance: each strategy changes exactly what it promises ---------------------------------

SEQ_CLS = tf.AutoModelForSequenceClassification
# (family, task class, strategy, what every trainable name must contain)
PROMISES = [
    ("bert", SEQ_CLS, "full", ""),
    ("bert", SEQ_CLS, "feature_extraction", "classifier."),
    ("bert", SEQ_CLS, "adapters", ("bottleneck_adapter", "classifier.")),
    ("bert", SEQ_CLS, "lora", ("lora_", "classifier.modules_to_save")),
    ("bert", SEQ_CLS, "prompt_tuning", ("prompt_encoder", "classifier.modules_to_save")),
    ("bert", tf.AutoModelForTokenClassification, "lora", ("lora_", "classifier.modules")),
    ("gpt2", SEQ_CLS, "lora", ("c_attn.lora_", "score.modules_to_save")),
    ("gpt2", SEQ_CLS, "adapters", ("bottleneck_adapter", "score.")),
    ("gpt2", tf.AutoModelForCausalLM, "lora", "lora_"),
    ("gpt2", tf.AutoModelForCausalLM, "adapters", "bottleneck_adapter"),
    ("t5", tf.AutoModelForSeq2SeqLM, "lora", "lora_"),
    ("t5", tf.AutoModelForSeq2SeqLM, "adapters", "bottleneck_adapter"),
    ("t5", SEQ_CLS, "adapters", ("bottleneck_adapter", "classification_head.")),
    ("llama", SEQ_CLS, "lora", ("lora_", "score.modules_to_save")),
]


@pytest.mark.parametrize(("family", "auto", "strategy", "marks"), PROMISES)
def test_strategy_changes_exactly_the_promised_parameters(
    family: str, auto: type[Any], strategy: str, marks: str | tuple[str, ...]
) -> None:
    model = tiny_model(family, auto)
    plan = apply_strategy(model, StrategyConfig(name=strategy), head_prefixes_for(model))
    promised = set(plan.trainable_names())
    allowed = (marks,) if isinstance(marks, str) else marks
    assert all(any(mark in name for mark in allowed) for name in promised), sorted(promised)
    before = snapshot(plan.model)

    train_steps(plan, batch_for(model))

    assert changed_names(plan.model, before) == promised


def test_full_and_feature_extraction_need_no_layer_depths_on_other_architectures() -> None:
    config = tf.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    model = SEQ_CLS.from_config(config)
    heads = head_prefixes_for(model)
    assert heads == ("classifier", "pre_classifier")
    plan = apply_strategy(model, StrategyConfig(name="feature_extraction"), heads)
    assert {n.split(".")[0] for n in plan.trainable_names()} == set(heads)
    plan = apply_strategy(model, StrategyConfig(name="full"), heads)
    assert len(plan.trainable_names()) == len(list(model.parameters()))


def test_full_strategy_with_a_tied_lm_head_trains_the_shared_embedding_as_head() -> None:
    model = tiny_model("gpt2", tf.AutoModelForCausalLM)
    plan = apply_strategy(model, StrategyConfig(name="feature_extraction"), ["lm_head"])
    assert plan.trainable_names() == ["transformer.wte.weight"]  # lm_head.weight is this tensor


def test_peft_strategies_refuse_head_lr_mult_when_only_an_lm_head_exists() -> None:
    model = tiny_model("t5", tf.AutoModelForSeq2SeqLM)
    with pytest.raises(ValueError, match="language-model head"):
        apply_strategy(model, StrategyConfig(name="lora", head_lr_mult=10), ["lm_head"])


@pytest.mark.parametrize("auto", [tf.AutoModelForTokenClassification, SEQ_CLS])
def test_prompt_tuning_refuses_tasks_whose_positions_it_would_shift(auto: type[Any]) -> None:
    model = tiny_model("bert" if auto is not SEQ_CLS else "gpt2", auto)
    with pytest.raises(ValueError, match="prompt_tuning cannot train"):
        apply_strategy(model, StrategyConfig(name="prompt_tuning"), head_prefixes_for(model))


# --- discriminative and layer-wise learning rates --------------------------------------------


def test_layer_decay_gives_each_parameter_the_documented_lr() -> None:
    # The worked table of docs/strategies.md: BERT, L = 4, lr 1e-4, layer_decay 0.8, head x5.
    torch.manual_seed(0)
    model = SEQ_CLS.from_config(tiny_config("bert", num_hidden_layers=4))
    cfg = StrategyConfig(name="full", layer_decay=0.8, head_lr_mult=5)
    plan = apply_strategy(model, cfg, head_prefixes_for(model))
    optimizer = torch.optim.AdamW(plan.param_groups(1e-4, weight_decay=0.01))
    GroupLRSchedule(optimizer, warmup_steps=0, total_steps=10, decay="constant")
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    table = {0: 4.096e-5, 1: 5.12e-5, 2: 6.4e-5, 3: 8.0e-5, 4: 1.0e-4, 5: 5.0e-4}
    for name, param in model.named_parameters():
        depth = 5 if name.startswith("classifier.") else layer_index(name, num_layers=4)
        assert lr_of[id(param)] == pytest.approx(table[depth], rel=1e-12), name
    assert {g["name"]: g["weight_decay"] for g in optimizer.param_groups}["body.d4.no_decay"] == 0


def test_head_lr_mult_scales_only_the_head_under_lora() -> None:
    model = tiny_model("bert", SEQ_CLS)
    plan = apply_strategy(model, StrategyConfig(name="lora", head_lr_mult=10), ["classifier"])
    lrs = {g["name"]: g["lr"] for g in plan.param_groups(2e-4, weight_decay=0.0)}
    assert lrs == {"lora": 2e-4, "head": pytest.approx(2e-3), "head.no_decay": pytest.approx(2e-3)}


# --- progressive unfreezing: plain AdamW and DeepSpeed (groups fixed at initialize) --------------


def torch_engine(model: torch.nn.Module, groups: list[dict[str, Any]]) -> tuple[Any, Callable]:
    optimizer = torch.optim.AdamW(groups)

    def step(batch: dict[str, torch.Tensor]) -> None:
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return optimizer, step


def deepspeed_engine(
    model: torch.nn.Module, groups: list[dict[str, Any]], stage: int
) -> tuple[Any, Callable]:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True, "adam_w_mode": True},
        },
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)

    def step(batch: dict[str, torch.Tensor]) -> None:
        engine.backward(engine(**batch).loss)
        engine.step()

    return engine.optimizer, step


@pytest.mark.parametrize(
    "engine",
    [
        "torch",
        pytest.param("zero0", marks=pytest.mark.slow),
        pytest.param("zero2", marks=pytest.mark.slow),
    ],
)
def test_progressive_unfreezing_changes_only_unfrozen_stages(
    engine: str, request: pytest.FixtureRequest
) -> None:
    model = tiny_model("bert", SEQ_CLS)
    cfg = StrategyConfig(name="progressive_unfreezing", layer_decay=0.9)
    plan = apply_strategy(model, cfg, head_prefixes_for(model))
    assert set(plan.trainable_names()) == {n for n, _ in model.named_parameters()}
    groups = plan.param_groups(1e-2, weight_decay=0.1)  # every stage in the optimizer at once
    if engine == "torch":
        optimizer, step = torch_engine(model, groups)
    else:
        request.getfixturevalue("single_process_dist")
        optimizer, step = deepspeed_engine(model, groups, stage=int(engine[-1]))
    schedule = GroupLRSchedule(optimizer, warmup_steps=1, total_steps=20, decay="constant")
    batch, stages = batch_for(model), []
    for epoch in range(plan.num_stages()):  # head; layer 2 + pooler; layer 1; embeddings
        plan.on_epoch_start(epoch)
        before = snapshot(model)
        for _ in range(2):
            step(batch)
            schedule.step()
        stages.append(changed_names(model, before))
        assert stages[-1] == set(plan.active_names()), f"stage {epoch}"
        moments = frozen_moments(optimizer)  # Adam state of the stages still frozen
        assert len(moments) > 0 or epoch == plan.num_stages() - 1
        assert all(m == 0.0 for m in moments), f"stage {epoch}"
    assert [len(s) for s in stages] == sorted(len(s) for s in stages)  # grows every stage
    assert stages[0] == {"classifier.weight", "classifier.bias"}


def frozen_moments(optimizer: Any) -> list[float]:
    """Largest |Adam first moment| of each parameter (or ZeRO flat partition) not yet unfrozen."""
    base = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps torch's AdamW
    return [
        float(base.state[p]["exp_avg"].abs().max())
        for group in base.param_groups
        if not group["active"]
        for p in group["params"]
        if p in base.state
    ]


def test_frozen_stages_keep_zero_adam_moments_until_unfrozen() -> None:
    model = tiny_model("bert", SEQ_CLS)
    plan = apply_strategy(model, StrategyConfig(name="progressive_unfreezing"), ["classifier"])
    optimizer, step = torch_engine(model, plan.param_groups(1e-2, weight_decay=0.1))
    plan.on_epoch_start(0)
    step(batch_for(model))
    frozen = model.bert.embeddings.word_embeddings.weight
    assert torch.count_nonzero(optimizer.state[frozen]["exp_avg"]) == 0
    assert torch.count_nonzero(optimizer.state[model.classifier.weight]["exp_avg"]) > 0


def test_adamw_weight_decay_moves_zero_gradient_weights_unless_lr_is_zero() -> None:
    # Why frozen stages need lr 0 and not just zero gradients (docs/strategies.md).
    weights = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    groups = [{"params": [weights[0]], "lr": 0.1}, {"params": [weights[1]], "lr": 0.0}]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.5)
    for weight in weights:
        weight.grad = torch.zeros(3)
    optimizer.step()
    assert not torch.equal(weights[0], torch.ones(3))
    assert torch.equal(weights[1], torch.ones(3))


def test_on_epoch_start_follows_unfreeze_every_epochs() -> None:
    model = tiny_model("bert", SEQ_CLS)
    cfg = StrategyConfig(name="progressive_unfreezing", unfreeze_every_epochs=2)
    plan = apply_strategy(model, cfg, ["classifier"])
    groups = plan.param_groups(1e-3, weight_decay=0.0)
    assert [plan.stage_for_epoch(e) for e in range(6)] == [0, 0, 1, 1, 2, 2]
    assert plan.on_epoch_start(1) == []
    assert plan.on_epoch_start(2) == ["body.d2", "body.d2.no_decay"]
    assert {g["name"]: g["lr"] for g in groups}["body.d2"] == pytest.approx(1e-3)
    assert {g["name"]: g["lr"] for g in groups}["body.d1"] == 0.0


# --- export -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_lora_export_is_a_plain_model_with_the_trained_outputs(family: str, tmp_path: Path) -> None:
    model = tiny_model(family, SEQ_CLS)
    plan = apply_strategy(model, StrategyConfig(name="lora"), head_prefixes_for(model))
    batch = batch_for(model)
    train_steps(plan, batch)
    expected = logits_of(plan.model, batch)

    exported = plan.merge_and_export_model()
    exported.save_pretrained(tmp_path)
    reloaded = SEQ_CLS.from_pretrained(tmp_path)

    assert type(reloaded) is type(model)
    assert not any("lora" in n or "modules_to_save" in n for n in reloaded.state_dict())
    assert torch.allclose(logits_of(reloaded, batch), expected, atol=1e-5)


def test_prompt_tuning_export_round_trip_gives_identical_logits(tmp_path: Path) -> None:
    model = tiny_model("bert", SEQ_CLS)
    cfg = StrategyConfig(name="prompt_tuning", prompt={"num_virtual_tokens": 4})
    plan = apply_strategy(model, cfg, ["classifier"])
    batch = batch_for(model)
    train_steps(plan, batch)
    expected = logits_of(plan.model, batch)

    files = plan.save_export(tmp_path)
    restored = load_finetuned(tmp_path, "classification")

    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in files}
    assert torch.equal(logits_of(restored, batch), expected)


def test_merge_and_export_model_ends_the_plan() -> None:
    model = tiny_model("bert", SEQ_CLS)
    plan = apply_strategy(model, StrategyConfig(name="full"), ["classifier"])
    assert plan.merge_and_export_model() is model
    with pytest.raises(RuntimeError, match="already"):
        plan.merge_and_export_model()


def test_a_dumped_strategy_config_validates_again_with_its_defaults() -> None:
    # Ray workers and run records get the config as JSON with every default written out.
    for name in ("full", "lora", "adapters", "prompt_tuning", "progressive_unfreezing"):
        cfg = StrategyConfig.model_validate({"name": name})
        assert StrategyConfig.model_validate(cfg.model_dump(mode="json")) == cfg
