"""The model table's objective groups pretrain on the demo corpus with DeepSpeed.

One run per objective group (ALBERT SOP, ELECTRA replaced-token detection, BART denoising,
MLM for the other encoders (DeBERTa), causal LM for the modern decoders (Mixtral under ZeRO-3
on 2 Ray workers, its expert blocks as ZeRO-3 leaves); distillation is in test_pretrain.py,
whose BERT it uses as the teacher). The ZeRO-2 groups run one worker in the test's own process
(`train.scale.launcher` auto), which saves each a Ray Train start; sharding across ranks is
what the Mixtral run and tests/reliability/test_resume_matrix.py check. Each run's held-out
loss must fall, and its export is registered in MLflow and reloads offline with its Auto
class. Every other family runs forward, backward, export and reload in-process
(test_model_families.py), to keep `make test` in its budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from training.models.export import load_export, read_card
from training.models.models import FAMILIES
from training.pretrain.config import TrainConfig
from training.scoring.plots import step_history

pytestmark = [pytest.mark.slow, pytest.mark.integration]

_ROBERTA_BPE = {"family": "bpe", "bpe_style": "roberta"}
# group: (family, objective, tokenizer, the token loss that must fall, extra train settings)
GROUPS: dict[str, tuple[str, str, dict[str, Any], str, dict[str, Any]]] = {
    "albert-sop": ("albert", "sop", {"family": "wordpiece"}, "eval_mlm_loss", {}),
    "electra-rtd": ("electra", "roberta", {"family": "wordpiece"}, "eval_rtd_loss", {}),
    "bart-denoising": ("bart", "denoising", _ROBERTA_BPE, "eval_denoise_loss", {}),
    "deberta-mlm": ("deberta-v2", "roberta", _ROBERTA_BPE, "eval_mlm_loss", {}),
    "mixtral-causal-zero3": ("mixtral", "causal", {"family": "bpe"}, "eval_lm_loss", {"zero": 3}),
}


def train_config(family: str, storage: Path, zero: int = 2) -> TrainConfig:
    # ZeRO-3 shards the weights across ranks: only with 2 workers does that happen.
    scale = {"num_workers": 2} if zero == 3 else {"num_workers": 1, "threads_per_worker": 2}
    return TrainConfig.model_validate(
        {
            "model": {"family": family, "size": "tiny"},
            "max_steps": 24,
            "global_batch_size": 32,
            "micro_batch_size": 16,
            "zero_stage": zero,
            "optim": {"lr": 3e-3, "warmup_steps": 4},
            "checkpoint": {"every_steps": 24, "storage_path": str(storage)},
            "eval": {"every_steps": 12, "max_samples": 64},
            "scale": scale | {"max_failures": 0},
        }
    )


@pytest.mark.parametrize("group", list(GROUPS))
def test_objective_group_pretrains_and_its_held_out_loss_falls(
    group: str, demo_data: Any, mlflow_uri: str, tmp_path: Path
) -> None:
    family, objective, tokenizer, token_loss, extra = GROUPS[group]
    data = demo_data.examples(objective, tokenizer=tokenizer)
    cfg = train_config(family, tmp_path / "runs", **extra)
    summary = demo_data.pretrain(
        cfg, data, tmp_path / "ws", mlflow_uri, f"fam-{group}", "family-pretraining"
    )
    evals = step_history(Path(summary["run_dir"]) / "evals.jsonl")
    first, last = evals[min(evals)], evals[max(evals)]
    assert last["eval_loss"] < first["eval_loss"], (first, last)
    assert last[token_loss] < first[token_loss], (first, last)

    export = Path(summary["export_dir"])
    card = read_card(export)
    expected = (family, 24, extra.get("zero", 2))
    assert (card.family, card.steps, card.deepspeed["zero_stage"]) == expected
    model, tok = load_export(export, family)  # offline, safetensors only, no key missing
    assert type(model) is FAMILIES[family].model  # type: ignore[index]
    assert summary["model_version"]
    with torch.no_grad():
        if FAMILIES[family].kind != "encoder":  # type: ignore[index]
            prompt = tok("the", return_tensors="pt")
            out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
            assert out.shape[1] >= 2
        else:
            enc = tok("the a", return_tensors="pt")
            logits = model(**enc)[0]  # MLM, pretraining (ALBERT) or discriminator (ELECTRA) head
            assert logits.shape[:2] == enc["input_ids"].shape
