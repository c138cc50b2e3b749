"""The outside reference of bench/pretrain_gpu.py: a minimal nanoGPT-style GPT-2.

`nanogpt_model` is GPT-2 as nanoGPT writes it (fused QKV, `scaled_dot_product_attention` with
`is_causal=True`, the head tied to the token embedding, the next-token loss in its forward);
`nanogpt_state` renames transformers' GPT-2 weights to it, so that it starts from the same
initial state as the other arms.
"""

from __future__ import annotations

from typing import Any


def nanogpt_model(config: Any) -> Any:
    """A minimal nanoGPT-style GPT-2 of `config`'s shape: fused QKV, SDPA with is_causal."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, heads = config.n_embd, config.n_head

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
            mlp: torch.Tensor = self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
            return x + mlp

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(config.vocab_size, d)
            self.wpe = nn.Embedding(config.n_positions, d)
            self.h = nn.ModuleList(Block() for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight  # tied

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.wte(ids) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))  # (B, T, V)
            targets = F.pad(ids[:, 1:], (0, 1), value=-1)  # the next token; none after the last
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    return GPT()


def nanogpt_state(hf_state: dict[str, Any]) -> dict[str, Any]:
    """The transformers GPT-2 weights under nanoGPT's names (its Conv1D weights transposed)."""
    names = {
        "attn.c_attn": "c_attn",
        "attn.c_proj": "attn_proj",
        "mlp.c_fc": "c_fc",
        "mlp.c_proj": "mlp_proj",
        "ln_1": "ln_1",
        "ln_2": "ln_2",
    }
    out = {}
    for key, value in hf_state.items():
        key = key.removeprefix("transformer.")  # lm_head.weight (tied to wte) keeps its name
        parts = key.split(".")
        if parts[0] == "h":
            inner = ".".join(parts[2:-1])
            key = f"h.{parts[1]}.{names[inner]}.{parts[-1]}"
            if parts[-1] == "weight" and inner.startswith(("attn.", "mlp.")):
                value = value.t()  # Conv1D keeps (in, out), nn.Linear (out, in)
        out[key] = value
    return out
