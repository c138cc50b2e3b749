"""The BERT reference of bench/pretrain_gpu.py: a minimal nanoGPT-style BERT with MLM and NSP.

`nanobert_model` is transformers' `BertForPreTraining` written out as nanoGPT writes GPT-2:
fused QKV, `scaled_dot_product_attention` (a boolean padding mask only where a batch has
padding), post-LayerNorm blocks, the MLM head tied to the token embedding and applied only at
the masked positions (original BERT's sparse MLM), NSP on the pooled first token, and the loss
(MLM + NSP, the padded vocabulary rows masked as lmpipe's loss masks them) in its forward.
`nanobert_state` maps `BertForPreTraining`'s weights onto it name by name (query, key and
value concatenated into the fused QKV), so that it starts from the same initial state as the
other arms; a weight it does not know is an error. `nanobert_inputs` picks the forward's
arguments from a batch of lmpipe's `BatchBuilder`.

Only the standard library is imported at the top, as in the other benchmark modules.
"""

from __future__ import annotations

import re
from typing import Any

#: BertForPreTraining's modules outside the layers -> this model's (both names of a tied
#: weight, the decoder's and the embedding's, map to the one tied weight).
_OUTER = {
    "bert.embeddings.word_embeddings": "wte",
    "bert.embeddings.position_embeddings": "wpe",
    "bert.embeddings.token_type_embeddings": "wtt",
    "bert.embeddings.LayerNorm": "ln_e",
    "bert.pooler.dense": "pool",
    "cls.predictions.transform.dense": "head_fc",
    "cls.predictions.transform.LayerNorm": "head_ln",
    "cls.predictions.decoder": "lm_head",
    "cls.predictions": "lm_head",  # its `bias` is the decoder's bias
    "cls.seq_relationship": "nsp",
}
#: A layer's modules -> this block's; query, key and value go into `qkv`, in that order.
_LAYER = {
    "attention.output.dense": "attn_proj",
    "attention.output.LayerNorm": "ln_1",
    "intermediate.dense": "fc",
    "output.dense": "mlp_proj",
    "output.LayerNorm": "ln_2",
}
_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")
_LAYER_KEY = re.compile(r"bert\.encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")


def _encoder_class(config: Any) -> Any:
    """The encoder of `config`'s shape: embeddings, post-LN blocks, the pooler (no heads)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_eps
    p_hidden, p_attn = config.hidden_dropout_prob, config.attention_probs_dropout_prob

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc = nn.Linear(d, config.intermediate_size)
            self.mlp_proj = nn.Linear(config.intermediate_size, d)
            self.ln_1, self.ln_2 = nn.LayerNorm(d, eps), nn.LayerNorm(d, eps)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (
                z.view(b, t, heads, d // heads).transpose(1, 2) for z in self.qkv(x).split(d, 2)
            )  # (B, H, T, D/H) each
            p = p_attn if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
            y = self.attn_proj(y.transpose(1, 2).reshape(b, t, d))  # (B, T, D)
            x = self.ln_1(x + F.dropout(y, p_hidden, self.training))  # post-LN, as BERT
            y = self.mlp_proj(F.gelu(self.fc(x)))
            out: torch.Tensor = self.ln_2(x + F.dropout(y, p_hidden, self.training))
            return out

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(config.vocab_size, d)
            self.wpe = nn.Embedding(config.max_position_embeddings, d)
            self.wtt = nn.Embedding(config.type_vocab_size, d)
            self.ln_e = nn.LayerNorm(d, eps)
            self.h = nn.ModuleList(Block() for _ in range(config.num_hidden_layers))
            self.pool = nn.Linear(d, d)

        def encode(
            self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """The last hidden states (B, T, D) and the pooled first token (B, D)."""
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.ln_e(self.wte(ids) + self.wpe(pos) + self.wtt(types))
            x = F.dropout(x, p_hidden, self.training)
            attend = None if mask is None else mask.bool()[:, None, None, :]  # (B, 1, 1, T)
            for block in self.h:
                x = block(x, attend)
            return x, torch.tanh(self.pool(x[:, 0]))

    return Encoder


def nanobert_model(config: Any) -> Any:
    """A minimal BERT of `config`'s shape (a transformers `BertConfig`): MLM + NSP heads."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, vocab = config.hidden_size, config.vocab_size
    real = getattr(config, "unpadded_vocab_size", vocab)  # rows past it are padding

    class Bert(_encoder_class(config)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.head_fc, self.head_ln = nn.Linear(d, d), nn.LayerNorm(d, config.layer_norm_eps)
            self.lm_head, self.nsp = nn.Linear(d, vocab), nn.Linear(d, 2)
            self.lm_head.weight = self.wte.weight  # tied

        def predict(self, rows: torch.Tensor) -> torch.Tensor:
            """MLM logits (..., V) of hidden rows (..., D)."""
            logits: torch.Tensor = self.lm_head(self.head_ln(F.gelu(self.head_fc(rows))))
            return logits

        def logits(
            self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """MLM logits at every position (B, T, V) and NSP logits (B, 2), as HF's."""
            hidden, pooled = self.encode(ids, types, mask)
            return self.predict(hidden), self.nsp(pooled)

        def forward(
            self,
            ids: torch.Tensor,
            types: torch.Tensor,
            mask: torch.Tensor | None,
            positions: torch.Tensor,
            labels: torch.Tensor,
            nsp_labels: torch.Tensor,
        ) -> torch.Tensor:
            """MLM loss at the masked `positions` (M,) (flat indices) plus the NSP loss."""
            hidden, pooled = self.encode(ids, types, mask)
            logits = self.predict(hidden.flatten(0, 1).index_select(0, positions))  # (M, V)
            logits[:, real:] = torch.finfo(logits.dtype).min  # padded rows: probability 0
            targets = labels.flatten().index_select(0, positions)  # (M,)
            mlm = F.cross_entropy(logits.float(), targets)
            return mlm + F.cross_entropy(self.nsp(pooled).float(), nsp_labels)

    return Bert()


def nanobert_state(hf_state: dict[str, Any]) -> dict[str, Any]:
    """`BertForPreTraining`'s weights under this model's names (query, key, value fused).

    Raises:
        KeyError: a weight with no place here (the mapping is exact, not best-effort).
    """
    import torch

    out: dict[str, Any] = {}
    fused: dict[str, dict[str, Any]] = {}
    for key, value in hf_state.items():
        layer = _LAYER_KEY.fullmatch(key)
        if layer is None:
            module, _, param = key.rpartition(".")
            out[f"{_OUTER[module]}.{param}"] = value
        elif layer[2] in _QKV:
            fused.setdefault(f"h.{layer[1]}.qkv.{layer[3]}", {})[layer[2]] = value
        else:
            out[f"h.{layer[1]}.{_LAYER[layer[2]]}.{layer[3]}"] = value
    for key, parts in fused.items():
        out[key] = torch.cat([parts[name] for name in _QKV])  # (3D, D) or (3D,)
    for name, tied in (("wte.weight", "lm_head.weight"), ("lm_head.weight", "wte.weight")):
        out.setdefault(name, out[tied])  # the tied weight, under both names
    return out


def nanobert_inputs(batch: dict[str, Any]) -> tuple[Any, ...]:
    """The forward's arguments from a BERT batch; the masked count marked dynamic for compile.

    A batch without padding carries no `attention_mask` (SDPA then runs unmasked).
    """
    import torch

    positions = batch["masked_positions"]  # (M,): M varies from batch to batch
    torch._dynamo.maybe_mark_dynamic(positions, 0)
    return (
        batch["input_ids"],
        batch["token_type_ids"],
        batch.get("attention_mask"),
        positions,
        batch["labels"],
        batch["next_sentence_label"],
    )
