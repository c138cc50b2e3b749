"""The BERT reference arm of bench/time_to_quality.py: a plain loop over `BertForPreTraining`.

Run as `python bench/mlm_reference.py --child SPEC` (bench/time_to_quality.py --family bert
does). What it does, all of it timed (the parent's clock runs from the spawn of this process):

- data: the sentence pairs of lmpipe's example stage for the recipe (`[CLS] A [SEP] B [SEP]`,
  token types, next-sentence labels; the same token stream as lmpipe's arm, cut once by the
  bench's untimed set-up), read from their Arrow shards into features as a `datasets` map
  would give them (ids, token types, special-tokens mask, label: lists per row);
- batches: a shuffled `DataLoader` (the tail of an epoch dropped) through transformers'
  `DataCollatorForLanguageModeling` with lmpipe's tokenizer: each batch padded to its longest
  row and masked anew (the recipe's share, 80% `[MASK]`, 10% a random id, 10% unchanged);
- the model: `BertForPreTraining` of lmpipe's config for the recipe, its weights drawn after
  `torch.manual_seed(seed)` as lmpipe draws them, and bench/plain_reference.py's loop: the sum
  of the dense masked-LM and next-sentence losses that `BertForPreTraining` returns;
- evaluations every `eval_every` steps (and at step 0) on the fixed validation batch, with
  `masked_lm_loss`, the function that also evaluates lmpipe's checkpoints.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_reference import Batch, build_model, run_child
from time_to_quality import read_arrow


def read_pairs(examples_dir: Path, special_ids: list[int]) -> list[dict[str, Any]]:
    """The train split's pairs, one feature dict per row, cut to the row's length."""
    manifest = json.loads((examples_dir / "manifest.json").read_text())
    specials = np.asarray(special_ids)
    features: list[dict[str, Any]] = []
    for entry in manifest["splits"]["train"]["shards"]:
        table = read_arrow(examples_dir / entry["name"])
        width = table.schema.field("input_ids").type.list_size
        columns = {
            name: table.column(name).combine_chunks().flatten().to_numpy().reshape(-1, width)
            for name in ("input_ids", "token_type_ids")
        }
        lengths = table.column("length").to_numpy()
        labels = table.column("next_sentence_label").to_numpy()
        for i, n in enumerate(lengths.tolist()):
            ids = columns["input_ids"][i, :n]
            features.append(
                {
                    "input_ids": ids.tolist(),
                    "token_type_ids": columns["token_type_ids"][i, :n].tolist(),
                    "special_tokens_mask": np.isin(ids, specials).astype(np.int64).tolist(),
                    "next_sentence_label": int(labels[i]),
                }
            )
    return features


def batches(
    spec: dict[str, Any], tokenizer: Any, features: list[dict[str, Any]]
) -> Iterator[Batch]:
    """Masked batches of `features`, epoch after epoch, each epoch in a new shuffled order."""
    import transformers as tf

    recipe = spec["recipe"]
    collator = tf.DataCollatorForLanguageModeling(
        tokenizer,
        mlm_probability=recipe["mlm_probability"],
        mask_replace_prob=recipe["mask_replace_prob"],
        random_replace_prob=recipe["random_replace_prob"],
    )
    loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
        features,  # type: ignore[arg-type]
        batch_size=recipe["batch"],
        shuffle=True,
        drop_last=True,
        collate_fn=collator,
        generator=torch.Generator().manual_seed(spec["seed"]),
    )
    while True:
        yield from loader


def prepare(spec: dict[str, Any]) -> tuple[torch.nn.Module, Iterator[Batch]]:
    """The model and the batch stream of the BERT reference arm."""
    import transformers as tf

    model = build_model(spec, tf.BertForPreTraining)
    tokenizer = tf.AutoTokenizer.from_pretrained(spec["tokenizer"])
    features = read_pairs(Path(spec["examples"]), tokenizer.all_special_ids)
    return model, batches(spec, tokenizer, features)


if __name__ == "__main__":
    run_child(prepare)
