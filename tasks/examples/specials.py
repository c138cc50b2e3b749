"""The token ids each objective needs, mapped from the tokenizer's manifest, or a refusal.

A tokenizer family without the tokens an objective needs (T5's sentinels, a mask token) is
refused here, before any shard is read, with the family to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.common.schema import ObjectiveMismatchError
from tasks.tokenizer.tokenizer import TokenizerConfig, roles


@dataclass(frozen=True)
class Specials:
    """The token ids an objective needs, taken from the tokenizer's manifest."""

    cls: int | None
    sep: int | None
    pad: int
    mask: int | None
    eos: int | None
    sentinel_top: int | None  # id of <extra_id_0>: T5 sentinels count down from it
    vocab_size: int
    special_ids: frozenset[int]


_NEEDS = {
    "bert": ("cls", "sep", "mask"),
    "sop": ("cls", "sep", "mask"),
    "roberta": ("cls", "sep", "mask"),
    "causal": ("eos",),
    "span_corruption": ("eos",),
    "denoising": ("cls", "eos", "mask", "pad"),  # <s>, </s> (also the decoder start), mask, pad
}
_USE = {
    "span_corruption": "tokenizer.family=unigram",
    "denoising": "tokenizer.family=bpe with tokenizer.bpe_style=roberta, or "
    "tokenizer.family=wordpiece",
}


def objective_specials(
    objective: str, tok_cfg: TokenizerConfig, ids: dict[str, int], vocab_size: int
) -> Specials:
    """Map the tokenizer's special tokens to the roles `objective` needs, or refuse the pair.

    Raises:
        ObjectiveMismatchError: a needed role has no token in this tokenizer family.
    """
    role = {name: ids.get(token) for name, token in roles(tok_cfg).items()}
    if tok_cfg.family == "wordpiece":
        role["eos"] = ids.get("[SEP]")  # a document separator for causal blocks
    missing = [name for name in _NEEDS[objective] if role.get(name) is None]
    sentinel_top = ids.get("<extra_id_0>")
    if objective == "span_corruption" and sentinel_top is None:
        missing.append("sentinels <extra_id_0>...")
    if missing:
        style = f" ({tok_cfg.bpe_style} style)" if tok_cfg.family == "bpe" else ""
        raise ObjectiveMismatchError(
            f"examples.objective={objective} needs {missing}, which a tokenizer.family="
            f"{tok_cfg.family} tokenizer{style} does not have; use "
            + _USE.get(objective, "tokenizer.family=wordpiece")
        )
    pad = role.get("pad")
    if pad is None:
        pad = role["eos"]  # GPT-2 has no padding token; blocks are full anyway
    assert pad is not None
    return Specials(
        cls=role.get("cls"),
        sep=role.get("sep"),
        pad=pad,
        mask=role.get("mask"),
        eos=role.get("eos"),
        sentinel_top=sentinel_top,
        vocab_size=vocab_size,
        special_ids=frozenset(ids.values()),
    )
