"""Document-boundary masking of packed causal blocks, checked on the real model classes."""

import numpy as np
import pytest
import torch
import transformers as tf

from training.pretrain.packing import causal_document_mask, document_ids, document_positions

STARTS = [[5, 12], [9]]  # block 0: documents at 0, 5, 12; block 1: at 0, 9
LENGTH = 16


def test_positions_restart_at_each_document() -> None:
    positions = document_positions(STARTS, LENGTH)
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
    assert positions[1].tolist() == [*range(9), *range(7)]
    assert document_ids(STARTS, LENGTH)[0].tolist() == [0] * 5 + [1] * 7 + [2] * 4


def models() -> list[tf.PreTrainedModel]:
    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    )
    llama = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
    )
    return [gpt2.eval(), llama.eval()]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("model_index", [0, 1], ids=["gpt2", "llama"])
def test_other_documents_leave_a_documents_logits_bit_identical(
    attention: str, model_index: int
) -> None:
    model = models()[model_index]
    model.config._attn_implementation = attention
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 100, (2, LENGTH)))
    documents = torch.from_numpy(document_ids(STARTS, LENGTH))
    mask = causal_document_mask(documents, torch.float32)
    positions = torch.from_numpy(document_positions(STARTS, LENGTH))

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=tokens, attention_mask=mask, position_ids=positions)
        return out.logits

    base = logits(ids)
    changed = ids.clone()
    changed[0, 5:12] = (changed[0, 5:12] + 1) % 100  # rewrite the middle document of block 0
    after = logits(changed)
    assert torch.equal(after[0, :5], base[0, :5])  # the document before it
    assert torch.equal(after[0, 12:], base[0, 12:])  # and the one after it: bit-identical
    assert not torch.equal(after[0, 5:12], base[0, 5:12])
    assert torch.equal(after[1], base[1])

    # The last document of block 0 behaves as if it ran alone: positions were honoured.
    with torch.no_grad():
        alone = model(input_ids=ids[:1, 12:]).logits
    torch.testing.assert_close(base[0, 12:], alone[0], rtol=1e-5, atol=1e-5)

    # Without the document mask the same edit leaks into the next document.
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        leaked = model(input_ids=changed).logits
    assert not torch.equal(plain[0, 12:], leaked[0, 12:])
