"""GPT-2's fast class: `GPT2LMHeadModel` with a lean forward for causal pretraining.

`FastGPT2LMHeadModel` adds no parameter, buffer or module: its state dict, its initialisation
under a seed and its checkpoints are the stock class's. Only `forward` changes, and only for the
calls pretraining makes (training/pretrain/losses/decoder.py): token ids, no mask or a 4-D
document mask, `position_ids` or none, no KV cache, SDPA attention. There it runs the stock
modules' operations on the same weights (Conv1D's `addmm` on its (in, out) weight, SDPA with
each layer's scale and dropout, the config's activation) as one straight function, without the
stock path's per-call work: the output-capturing and config-default decorators, the padding
check and `create_causal_mask` (either may read a tensor on the host), the attention-interface
lookup and its checks, and a module call per Conv1D and dropout. Any other call (a 2-D
padding mask, a FlexAttention `BlockMask`, a KV cache, activation checkpointing, ZeRO-3 or any
hook on a submodule, `logits_to_keep`, extra outputs, another attention implementation) runs
the stock forward. Elsewhere: the registry (`training.models.fast.FAST_CLASSES`) and the
export (`as_stock`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle
from transformers import GPT2LMHeadModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.pytorch_utils import Conv1D

from training.models.attention import DOCUMENT_FLEX
from training.models.bias import has_zero_biases

#: Attention implementations whose layers run `F.scaled_dot_product_attention` on a tensor
#: mask or none: transformers' SDPA, and lmpipe's document FlexAttention without a BlockMask.
SDPA_IMPLEMENTATIONS = frozenset({"sdpa", DOCUMENT_FLEX})


class FastGPT2LMHeadModel(GPT2LMHeadModel):  # type: ignore[no-untyped-call]
    """`GPT2LMHeadModel` whose pretraining forward skips the stock per-call overhead.

    Same parameters, same names, same order of creation: under one torch seed its fresh state
    dict equals the stock class's. Outputs equal the stock forward's within float rounding.
    """

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        """Next-token logits (and the loss, given `labels`), as `GPT2LMHeadModel.forward`.

        The signature is the stock one, so that generation and other callers that inspect it
        see no difference. Calls the fast path does not cover go to the stock forward.
        """
        others = (past_key_values, token_type_ids, inputs_embeds, encoder_hidden_states)
        if (
            input_ids is not None
            and input_ids.dim() == 2
            and all(other is None for other in others)
            and encoder_attention_mask is None
            and not kwargs
            and isinstance(logits_to_keep, int)
            and logits_to_keep == 0
            and not _wants_cache(self, use_cache)
            and _covered_inputs(attention_mask, position_ids)
            and self._fast_path_ready()
        ):
            logits = causal_lm_logits(self, input_ids, attention_mask, position_ids)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size)
            return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)
        return super().forward(
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )

    def pretraining_logits(
        self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
    ) -> Tensor | None:
        """The logits `forward` returns for pretraining's call, without calling the module.

        None where `forward` would take the stock path, or where the model has hooks of its
        own (only a module call fires them): the caller then calls the model. Spares the call's
        dispatch, its checks and the output object: 0.18 ms of a 32 ms forward and backward at
        nanoGPT's shape on a 2-core CPU (interleaved with the module call, medians of 490).
        """
        if (
            self._forward_hooks
            or self._forward_pre_hooks
            or self._backward_hooks
            or self._backward_pre_hooks
            or input_ids.dim() != 2
            or not _covered_inputs(attention_mask, position_ids)
            or not self._fast_path_ready()
        ):
            return None
        return causal_lm_logits(self, input_ids, attention_mask, position_ids)

    def _fast_path_ready(self) -> bool:
        """Whether the model's state lets the fast path stand in for the stock forward.

        Hooks on submodules (DeepSpeed ZeRO-3 gathers partitioned weights in them; adapters
        and probes use them) fire only when a submodule is called, which the fast path does
        not do per layer.
        """
        config = self.config
        if config._attn_implementation not in SDPA_IMPLEMENTATIONS:
            return False
        if not getattr(config, "is_causal", True) or not config.return_dict:
            return False
        gpt = self.transformer
        if gpt.gradient_checkpointing or any(b.gradient_checkpointing for b in gpt.h):
            return False
        if hasattr(gpt.wte.weight, "ds_id"):  # ZeRO-3 partitions every weight (and marks it)
            return False
        return not _hooked(self)


def _wants_cache(model: FastGPT2LMHeadModel, use_cache: bool | None) -> bool:
    """Whether the stock forward would build and return a KV cache (the config's default)."""
    return bool(model.config.use_cache if use_cache is None else use_cache)


def _covered_inputs(mask: Any, position_ids: Any) -> bool:
    """No mask or a 4-D tensor mask (not a `BlockMask`); positions absent or (B or 1, T)."""
    mask_ok = mask is None or (isinstance(mask, Tensor) and mask.dim() == 4)
    return mask_ok and (position_ids is None or position_ids.dim() == 2)


def _hooked(model: nn.Module) -> bool:
    """Whether a forward or backward hook is registered on a submodule of `model`, or globally.

    The model's own hooks (DeepSpeed's engine puts some on it) fire around this forward as
    they do around the stock one; a submodule's would not. Asked at every forward: a walk
    that found no hook is remembered until a hook or a module is registered anywhere in the
    process (`_registrations`), so a step does not walk the module tree again (the walk's
    objects are out of the caches after a backward: 70 us of a nanoGPT-shape CPU step).
    """
    if (
        torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    ):
        return True
    seen = _registrations()
    if model.__dict__.get(_HOOK_FREE_AT) == seen:
        return False
    if _submodule_hooked(model):
        return True
    model.__dict__[_HOOK_FREE_AT] = seen
    return False


#: The instance attribute that holds `_registrations()` at the last walk that found no hook.
_HOOK_FREE_AT = "_lmpipe_hook_free_at"
_modules_registered = [0]


def _count_module(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    _modules_registered[0] += 1


def _registrations() -> tuple[int, int]:
    """Hooks and submodules registered so far in this process (a key that only grows).

    Every hook registration makes a `RemovableHandle`, whose ids count up process-wide; a
    submodule set or replaced anywhere is counted by a module-registration hook, installed at
    the first call (before it, no walk was remembered). A removal changes neither, and needs
    no new walk: a model without hooks keeps none when one is removed.
    """
    if _modules_registered[0] == 0:
        torch_module.register_module_module_registration_hook(_count_module)
        _modules_registered[0] = 1
    return RemovableHandle.next_id, _modules_registered[0]


def _submodule_hooked(module: nn.Module) -> bool:
    for child in module._modules.values():
        if child is not None and (
            child._forward_hooks
            or child._forward_pre_hooks
            or child._backward_hooks
            or child._backward_pre_hooks
            or _submodule_hooked(child)
        ):
            return True
    return False


def causal_lm_logits(
    model: FastGPT2LMHeadModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
) -> Tensor:
    """(B, T, V) logits of `input_ids` (B, T): the stock forward's operations, inlined.

    `attention_mask` is None (causal) or 4-D, used as given; with no mask, `position_ids`
    that restart mark packed sequences, which attend only within themselves (as transformers'
    `create_causal_mask` reads them), here without asking the host whether they restart.
    """
    gpt = model.transformer
    batch, length = input_ids.shape
    # No ids: the (T, D) rows an arange would gather; else (B or 1, T, D)
    positions = gpt.wpe.weight[:length] if position_ids is None else gpt.wpe(position_ids)
    x = gpt.wte(input_ids) + positions  # (B, T, D)
    x = _dropout(x, gpt.drop.p, model.training).reshape(batch * length, -1)  # (B*T, D)
    if attention_mask is None and position_ids is not None:
        attention_mask = packed_sequence_mask(position_ids, batch)
    # Zero, frozen biases (`model.bias: false`) are left out: adding a zero changes nothing.
    biases = not has_zero_biases(model)
    for block in gpt.h:
        x = _block(cast(GPT2Block, block), x, attention_mask, batch, model.training, biases)
    # (B, T, D): a 3-D input makes the logits a fresh tensor, not a view, so the loss's
    # in-place masking of padded vocabulary columns costs no gradient copy (CopySlices)
    x = x.view(batch, length, -1)
    x = _layer_norm(x, gpt.ln_f, biases)
    return F.linear(x, model.lm_head.weight, model.lm_head.bias)  # (B, T, V)


def packed_sequence_mask(position_ids: Tensor, batch: int) -> Tensor:
    """(B, 1, T, T) boolean mask: causal, within runs of `position_ids` that count up by 1.

    transformers' `find_packed_sequence_indices` rule; a row of one run is plain causal.
    """
    positions = position_ids.expand(batch, -1)  # (B, T)
    steps = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    runs = (steps != 1).cumsum(-1)  # (B, T): the packed sequence of each token
    length = positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return ((runs[:, :, None] == runs[:, None, :]) & causal)[:, None]  # (B, 1, T, T)


def _block(
    block: GPT2Block, x: Tensor, mask: Tensor | None, batch: int, training: bool, biases: bool
) -> Tensor:
    """One pre-LN GPT-2 block on `x` (B*T, D), as `GPT2Block.forward` computes it."""
    attn, mlp = block.attn, block.mlp
    width, heads = x.shape[-1], attn.num_heads
    qkv = _conv1d(_layer_norm(x, block.ln_1, biases), attn.c_attn, biases)  # (B*T, 3D)
    # The stock split: three (B*T, D) slices, each viewed as (B, H, T, D/H). Its backward
    # concatenates the three gradients, cheaper than stacking them and copying back out of a
    # permuted (B, T, 3, H, D/H) view.
    q, k, v = (
        z.view(batch, -1, heads, width // heads).transpose(1, 2)
        for z in torch.split(qkv, width, dim=1)
    )
    y = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=attn.attn_dropout.p if training else 0.0,
        is_causal=mask is None and q.shape[2] > 1,  # the stock rule: one query sees itself
        scale=attn.scaling,
    )  # (B, H, T, D/H)
    y = _conv1d(y.transpose(1, 2).reshape(x.shape), attn.c_proj, biases)  # (B*T, D)
    x = x + _dropout(y, attn.resid_dropout.p, training)
    h = mlp.act(_conv1d(_layer_norm(x, block.ln_2, biases), mlp.c_fc, biases))  # (B*T, 4D)
    h = _conv1d(h, mlp.c_proj, biases)
    return x + _dropout(h, mlp.dropout.p, training)


def _conv1d(x: Tensor, layer: Conv1D, bias: bool) -> Tensor:
    """A `Conv1D` on `x` (N, in): its own `addmm` on the (in, out) weight; `mm` without bias."""
    if bias:
        return torch.addmm(layer.bias, x, layer.weight)
    return torch.mm(x, layer.weight)


def _layer_norm(x: Tensor, norm: nn.LayerNorm, bias: bool) -> Tensor:
    """`norm` (a LayerNorm) on `x`, its bias left out where it is a frozen zero."""
    return F.layer_norm(
        x, norm.normalized_shape, norm.weight, norm.bias if bias else None, norm.eps
    )


def _dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """`nn.Dropout(p)` in `training` mode, or `x` itself where it would be the identity."""
    return F.dropout(x, p, training) if training and p > 0 else x
