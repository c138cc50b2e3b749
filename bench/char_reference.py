"""The reference arm of bench/time_to_quality.py: nanoGPT's character-level loop, written here.

Run as `python bench/char_reference.py --child SPEC` (bench/time_to_quality.py does). What it
does, all of it timed (the parent's clock runs from the spawn of this process):

- data preparation, as nanoGPT's `data/shakespeare_char/prepare.py` does it: read
  Tiny Shakespeare, build a character vocabulary, encode. The speeches (blank-line-separated
  blocks) that lmpipe's split holds out (`heldout` in the spec) are left out of training; the
  others are encoded one after another, each followed by a separator id (lmpipe's documents
  end with `<|endoftext|>`);
- nanoGPT's model: pre-LN blocks, fused QKV, `scaled_dot_product_attention(is_causal=True)`,
  GELU, no biases (nanoGPT's `bias=False`), the head tied to the token embedding, its
  initialisation (normal 0.02, residual projections 0.02/sqrt(2 x layers));
- nanoGPT's loop: random windows of the training stream, AdamW with weight decay on matrices
  only, linear warm-up then cosine decay to `min_lr`, gradient clipping at 1.0;
- evaluation every `eval_every` steps (and at step 0) on every held-out block, with the
  function both arms use (`heldout_loss` in bench/time_to_quality.py).

After the run, untimed: the honesty check of docs/benchmarks.md ("Time to quality"): this
model's ms per step against a plain AdamW loop over transformers' `GPT2LMHeadModel` of the
same shape and vocabulary, steps interleaved in this process.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_to_quality import blocks_of, heldout_loss


class Block(nn.Module):
    """One pre-LN transformer block, as nanoGPT writes it."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.attn_proj = nn.Linear(d, d, bias=False)
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.mlp_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for `x` (B, T, D)."""
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class CharGPT(nn.Module):
    """nanoGPT's GPT: token + position embeddings, blocks, final norm, tied head."""

    def __init__(self, vocab: int, block: int, layers: int, heads: int, d: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):  # the residual projections, as GPT-2 scales them
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T, V) next-token logits of `ids` (B, T)."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)  # (B, T, D)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def prepare(text_path: Path, heldout: list[str]) -> tuple[torch.Tensor, list[str], dict[str, int]]:
    """The training stream (speeches not held out, each + separator), the vocabulary."""
    text = text_path.read_text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    sep = len(chars)
    held = set(heldout)
    ids: list[int] = []
    for speech in text.split("\n\n"):
        speech = speech.strip()
        if speech and speech not in held:
            ids.extend(stoi[c] for c in speech)
            ids.append(sep)
    return torch.tensor(ids, dtype=torch.long), chars, stoi


def lr_at(step: int, cfg: dict[str, Any]) -> float:
    """Return nanoGPT's `get_lr`: linear warm-up, then cosine from `lr` to `min_lr`."""
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / (cfg["warmup"] + 1)
    ratio = (step - cfg["warmup"]) / (cfg["steps"] - cfg["warmup"])
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (
        cfg["lr"] - cfg["min_lr"]
    )


def optimizer_for(model: nn.Module, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    """Build nanoGPT's `configure_optimizers` AdamW: decay on matrices only; fused AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg["lr"], betas=(0.9, 0.99), fused=True)


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """Prepare, train and evaluate as nanoGPT does; return the evaluations with wall times."""
    cfg = spec["recipe"]
    torch.manual_seed(spec["seed"])
    heldout = json.loads(Path(spec["heldout"]).read_text())
    stream, chars, stoi = prepare(Path(spec["text"]), heldout)
    sep, block = len(chars), cfg["block"]
    eval_blocks = blocks_of(heldout, lambda s: [stoi[c] for c in s], sep, block)
    model = CharGPT(len(chars) + 1, block, cfg["layers"], cfg["heads"], cfg["d"])
    opt = optimizer_for(model, cfg)
    evals = []
    for step in range(cfg["steps"] + 1):
        if step % spec["eval_every"] == 0 or step == cfg["steps"]:
            model.eval()
            loss = heldout_loss(model, eval_blocks, sep)
            model.train()
            evals.append({"step": step, "loss": loss, "time": time.time()})
        if step == cfg["steps"]:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        starts = torch.randint(len(stream) - block - 1, (cfg["batch"],))
        x = torch.stack([stream[i : i + block] for i in starts.tolist()])  # (B, T)
        y = torch.stack([stream[i + 1 : i + 1 + block] for i in starts.tolist()])
        logits = model(x)
        loss_t = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    vocab, tokens = len(chars) + 1, len(stream)
    return {"evals": evals, "end": time.time(), "vocab": vocab, "train_tokens": tokens}


def honesty_check(spec: dict[str, Any], vocab: int, steps: int = 40) -> dict[str, float]:
    """Time a step (ms) of this model and of a plain loop over `GPT2LMHeadModel`, interleaved."""
    import transformers as tf

    cfg = spec["recipe"]
    torch.manual_seed(spec["seed"])
    ref = CharGPT(vocab, cfg["block"], cfg["layers"], cfg["heads"], cfg["d"])
    hf_cfg = tf.GPT2Config(
        vocab_size=vocab,
        n_positions=cfg["block"],
        n_embd=cfg["d"],
        n_layer=cfg["layers"],
        n_head=cfg["heads"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    hf = tf.GPT2LMHeadModel._from_config(hf_cfg, attn_implementation="sdpa")
    arms: dict[str, Any] = {}
    for name, model in (("reference", ref), ("plain", hf)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), fused=True)
        arms[name] = (model, opt, [])
    ids = torch.randint(vocab, (cfg["batch"], cfg["block"]))
    for i in range(steps + 5):
        for name in ("reference", "plain") if i % 2 == 0 else ("plain", "reference"):
            model, opt, times = arms[name]
            start = time.perf_counter()
            if name == "plain":
                loss = model(input_ids=ids, labels=ids).loss
            else:
                logits = model(ids)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 5:
                times.append(time.perf_counter() - start)
    ms = {name: statistics.median(arm[2]) * 1e3 for name, arm in arms.items()}
    return {"reference_ms": ms["reference"], "plain_ms": ms["plain"]} | {
        "reference_over_plain": ms["reference"] / ms["plain"]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", required=True, help="The arm's spec, as JSON.")
    spec = json.loads(parser.parse_args().child)
    torch.set_num_threads(spec["threads"])
    result = train(spec)
    result["honesty"] = honesty_check(spec, result["vocab"])
    Path(spec["result"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
