"""The plain loop of the BERT and T5 reference arms of bench/time_to_quality.py, and their loss.

bench/mlm_reference.py (BERT) and bench/span_reference.py (T5) each prepare their training
batches and build their model; this module holds what they share and what the lmpipe arm shares
with them:

- `evaluate`: the one evaluation of both arms of a family, on the fixed validation batch the
  bench writes once (`validation.npz`: lmpipe's validation examples, with the masks lmpipe's
  own evaluation draws for BERT and the spans its example stage wrote for T5). BERT: nats per
  masked token (and the next-sentence loss beside it); T5: nats per target token;
- `train`: the loop as transformers' examples write it: AdamW (fused, the Trainer's default;
  no decay on biases and norms), the linear warm-up and decay of
  `get_linear_schedule_with_warmup`, clipping, `model(**batch).loss`, and an evaluation every
  `eval_every` steps (and at step 0), timed;
- `run_child`: a reference arm's process (`--child SPEC`): threads, seed, the model from the
  bench's `config.json` (lmpipe's model config for the recipe), the loop, the result JSON.

The bench's untimed set-up, in its own process, also takes from here what it writes for both arms
(`reference_recipe`, `write_shared`): only those two import lmpipe's modules, where they run; the
reference arms import transformers and torch only.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

Batch = dict[str, torch.Tensor]
EVAL_BATCH = 64  # rows per evaluation forward pass (it changes no figure, only memory)


def load_validation(path: str | Path) -> Batch:
    """The fixed validation batch (`validation.npz`) as int64 tensors."""
    with np.load(path) as data:
        return {name: torch.from_numpy(data[name].astype(np.int64)) for name in data.files}


def _rows(val: Batch, start: int) -> Batch:
    return {name: value[start : start + EVAL_BATCH] for name, value in val.items()}


def masked_lm_loss(model: Any, val: Batch) -> dict[str, float]:
    """Nats per masked token (`loss`) and per pair (`nsp`) of a `BertForPreTraining`.

    `val` holds (N, L) `input_ids` (masked), `token_type_ids`, `labels` (-100 where nothing is
    predicted), optionally `attention_mask`, and (N,) `next_sentence_label`. The MLM head runs
    only at the masked positions: the loss is the dense head's, at a fraction of its cost.
    """
    nll, count, nsp = 0.0, 0, 0.0
    with torch.no_grad():
        for start in range(0, len(val["input_ids"]), EVAL_BATCH):
            rows = _rows(val, start)
            out = model.bert(
                input_ids=rows["input_ids"],
                token_type_ids=rows["token_type_ids"],
                attention_mask=rows.get("attention_mask"),
            )
            chosen = rows["labels"] != -100  # (B, L)
            logits = model.cls.predictions(out.last_hidden_state[chosen]).float()  # (M, V)
            nll += float(F.cross_entropy(logits, rows["labels"][chosen], reduction="sum"))
            count += int(chosen.sum())
            pair = model.cls.seq_relationship(out.pooler_output).float()  # (B, 2)
            nsp += float(F.cross_entropy(pair, rows["next_sentence_label"], reduction="sum"))
    return {"loss": nll / count, "nsp": nsp / len(val["input_ids"])}


def span_loss(model: Any, val: Batch) -> dict[str, float]:
    """Nats per target token of a `T5ForConditionalGeneration` on fixed span-corrupted rows.

    `val` holds (N, I) `input_ids` and (N, T) `labels` and `decoder_input_ids`; pad ids in
    the labels (none in full T5 rows) are left out.
    """
    pad = model.config.pad_token_id
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(val["input_ids"]), EVAL_BATCH):
            rows = _rows(val, start)
            logits = model(
                input_ids=rows["input_ids"],
                decoder_input_ids=rows["decoder_input_ids"],
                use_cache=False,
            ).logits.float()  # (B, T, V)
            targets = rows["labels"].masked_fill(rows["labels"] == pad, -100)
            nll += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
            count += int((targets != -100).sum())
    return {"loss": nll / count}


EVALUATORS: dict[str, Callable[[Any, Batch], dict[str, float]]] = {
    "bert": masked_lm_loss,
    "t5": span_loss,
}


def evaluate(family: str, model: Any, val: Batch) -> dict[str, float]:
    """The validation losses of `model` (family `bert` or `t5`), in eval mode."""
    was_training = model.training
    model.eval()
    losses = EVALUATORS[family](model, val)
    model.train(was_training)
    return losses


def optimizer_for(model: torch.nn.Module, recipe: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW as transformers' examples group it: no weight decay on biases and norms."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():  # every bias and norm weight of BERT and T5 is 1-D
        (no_decay if param.ndim < 2 else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": recipe["weight_decay"]},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # fused: transformers' Trainer default ("adamw_torch_fused") since torch 2.8
    betas = tuple(recipe["betas"])
    return torch.optim.AdamW(groups, lr=recipe["lr"], betas=betas, eps=recipe["eps"], fused=True)


def train(spec: dict[str, Any], model: torch.nn.Module, batches: Iterator[Batch]) -> dict[str, Any]:
    """Train `model` on `batches` for the recipe's steps; return the evaluations with times."""
    import transformers as tf

    recipe, family = spec["recipe"], spec["family"]
    val = load_validation(spec["validation"])
    opt = optimizer_for(model, recipe)
    schedule = tf.get_linear_schedule_with_warmup(  # type: ignore[no-untyped-call]
        opt, recipe["warmup"], recipe["steps"]
    )
    model.train()
    evals = []
    for step in range(recipe["steps"] + 1):
        if step % spec["eval_every"] == 0 or step == recipe["steps"]:
            evals.append({"step": step, **evaluate(family, model, val), "time": time.time()})
        if step == recipe["steps"]:
            break
        loss = model(**next(batches)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["grad_clip"])
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    return {"evals": evals, "end": time.time()}


def reference_recipe(cfg: Any) -> dict[str, Any]:
    """What the plain loop takes from lmpipe's resolved recipe: optimiser, schedule, data."""
    train, examples, optim = cfg.train, cfg.examples, cfg.train.optim
    if optim.decay != "linear" or optim.min_lr_ratio != 0.0 or train.precision != "fp32":
        # the plain loop's schedule is get_linear_schedule_with_warmup, in fp32
        raise SystemExit("the bert/t5 recipes must decay linearly to 0 and train in fp32")
    return {
        "steps": train.max_steps,
        "batch": train.global_batch_size,
        "lr": optim.lr,
        "betas": list(optim.betas),
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
        "grad_clip": optim.grad_clip,
        "warmup": min(optim.warmup_steps, train.max_steps),  # lmpipe's rule too
        "mlm_probability": examples.mask.masked_lm_prob,
        "mask_replace_prob": examples.mask.mask_token_prob,
        "random_replace_prob": examples.mask.random_token_prob,
        "length": examples.max_seq_length,
        "noise_density": examples.span.noise_density,
        "mean_span": examples.span.mean_noise_span_length,
    }


def write_shared(cfg: Any, examples: Path, tokenizer: Path, work: Path) -> None:
    """Write `validation.npz` (lmpipe's evaluation batch) and `config.json` (its model config)."""
    from training.models.models import model_config_for
    from training.models.vocab import UNPADDED_VOCAB
    from training.pretrain import data as lmpipe_data

    manifest = lmpipe_data.read_manifest(examples)
    rows = lmpipe_data.ExampleShards(examples, "validation")
    indices = np.arange(len(rows))
    masker = lmpipe_data.dynamic_masker(manifest, tokenizer, cfg.seed)
    build = lmpipe_data.BatchBuilder(manifest["objective"], masker)
    batch = build(rows.take(indices), indices, lmpipe_data.EVAL_EPOCH)  # as lmpipe evaluates
    kept = ("input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label")
    arrays = {k: v.numpy() for k, v in batch.items() if k in (*kept, "decoder_input_ids")}
    np.savez(work / "validation.npz", **arrays)
    specials = manifest["specials"]
    length = lmpipe_data.sequence_length(manifest)
    config = model_config_for(cfg.train.model, specials["vocab_size"], specials, length)
    if hasattr(config, UNPADDED_VOCAB):  # the plain model would train the padded rows
        raise SystemExit("choose a vocabulary size that is a multiple of 64")
    config.to_json_file(work / "config.json")


def build_model(spec: dict[str, Any], model_class: Any) -> torch.nn.Module:
    """`model_class` from the bench's `config.json`, its weights drawn after `seed` (as lmpipe)."""
    config = model_class.config_class.from_json_file(spec["config"])
    torch.manual_seed(spec["seed"])
    model: torch.nn.Module = model_class(config)
    return model


def run_child(
    prepare: Callable[[dict[str, Any]], tuple[torch.nn.Module, Iterator[Batch]]],
) -> None:
    """A reference arm's process: `--child SPEC`; `prepare` gives the model and its batches."""
    parser = argparse.ArgumentParser(description="A reference arm of bench/time_to_quality.py.")
    parser.add_argument("--child", required=True, help="The arm's spec, as JSON.")
    spec = json.loads(parser.parse_args().child)
    torch.set_num_threads(spec["threads"])
    model, batches = prepare(spec)
    result = train(spec, model, batches)
    Path(spec["result"]).write_text(json.dumps(result, indent=1))
