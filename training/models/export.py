"""Export a trained model as a Hugging Face directory, check it reloads, and load outside weights.

Here: consolidating DeepSpeed checkpoints into fp32 weights (`gather_state_dict`), the atomic
export (`export_model`), the reload check (`reload_check`), the loader of the model a pretrained
export serves its pipeline with (`load_serving_model`), the safetensors-only loader for user
weights (`load_external_weights`), the layouts of a fine-tuned export (`export_layout`) and the
loader of its peft layout (`load_peft_export`, with `unique_modules_to_save`), and keeping
transformers' load report of deliberately left-out weights off the terminal
(`quiet_load_report`). Not here: the model card and the pipeline task an export serves
(`training/models/cards.py`; the card's names are importable from here too), building models
(`training/models/models.py`), saving adapters and loading lmpipe's
(`training/finetune/adapters.py`) and the MLflow registry (`training/tracking/registry.py`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from safetensors.torch import load_file
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from training.models.cards import DataRef as DataRef
from training.models.cards import ModelCard as ModelCard
from training.models.cards import ModelFamily as ModelFamily
from training.models.cards import TokenizerRef as TokenizerRef
from training.models.cards import read_card as read_card
from training.models.cards import render_card, serving_class
from training.models.fast import as_stock
from training.models.models import FAMILIES, PAD_OFFSET_POSITIONS

log = logging.getLogger(__name__)

# The Auto class that reloads each family's pretraining head from an export.
AUTO_CLASSES: dict[str, Any] = {family: spec.auto for family, spec in FAMILIES.items()}
GENERATIVE = frozenset(family for family, spec in FAMILIES.items() if spec.kind != "encoder")
# Fine-tuned exports (keyed by downstream task type, tasks/common/schema.py): the Auto class that
# reloads them (the pipeline task they serve: `training.models.cards.TASK_PIPELINES`).
TASK_AUTO_CLASSES: dict[str, Any] = {
    "classification": AutoModelForSequenceClassification,
    "regression": AutoModelForSequenceClassification,
    "token_classification": AutoModelForTokenClassification,
    "question_answering": AutoModelForQuestionAnswering,
    "seq2seq": AutoModelForSeq2SeqLM,
    "causal_lm": AutoModelForCausalLM,
}
# Weight formats that unpickle on load, so can run code: never read from outside.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
_LOAD_KWARGS = ("local_files_only", "is_local")
# A fine-tuned export saved as adapters keeps the frozen base model in this sub-folder, with no
# weights at the top: a plain `from_pretrained` of the export fails instead of silently loading
# the model without its adapters (docs/strategies.md, "Exports").
BASE_MODEL_DIR = "base_model"
PEFT_CONFIG_FILE = "adapter_config.json"  # peft's adapter directory (LoRA, prompt tuning)
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTERS_CONFIG_FILE = "adapters.json"  # lmpipe's bottleneck adapters
ExportLayout = Literal["model", "peft", "adapters"]


class ExportCheckError(RuntimeError):
    """An export does not reload faithfully (loss, keys or vocabulary differ)."""


class UnsafeWeightsError(ValueError):
    """A weights directory holds only pickle files, which can run code when loaded."""


def gather_state_dict(checkpoint_dir: Path, tag: str) -> dict[str, Tensor]:
    """Consolidate the full fp32 weights of a DeepSpeed checkpoint of any ZeRO stage (0-3).

    Stages 1-3 keep fp32 master weights in `*_optim_states.pt` partitions, which DeepSpeed's
    `zero_to_fp32` merges. Stage 0 writes no partitions (and `zero_to_fp32` fails on it), so the
    module states are read directly; under bf16/fp16 at stage 0 they are the half-precision
    weights, upcast here. DeepSpeed's partitions are pickles: call it only on a checkpoint that
    `training.runtime.checkpoint.validate` passed (as `export_checkpoint` does), or on your own
    files.

    Args:
        checkpoint_dir: The directory given to `engine.save_checkpoint`.
        tag: The checkpoint tag (its subdirectory).

    Returns:
        Parameter and buffer names (any DDP `module.` prefix stripped) to fp32 CPU tensors.
    """
    ds_dir = checkpoint_dir / tag
    if not ds_dir.is_dir():
        raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {checkpoint_dir}")
    if any(ds_dir.glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(io.StringIO()) as report:  # it prints its progress
            state: dict[str, Tensor] = get_fp32_state_dict_from_zero_checkpoint(
                str(checkpoint_dir), tag=tag
            )
        log.debug("zero_to_fp32: %s", report.getvalue())
    else:
        # The model states hold only tensors and plain containers: no pickle code needed.
        saved = torch.load(ds_dir / "mp_rank_00_model_states.pt", weights_only=True)
        state = saved["module"]
        if any(t.is_floating_point() and t.dtype != torch.float32 for t in state.values()):
            log.warning("stage-0 checkpoint %s has no fp32 master weights; upcasting", ds_dir)
    return {
        key.removeprefix("module."): t.float() if t.is_floating_point() else t
        for key, t in state.items()
    }


def max_length(model: PreTrainedModel, default: int) -> int:
    """Longest input the model's position embeddings allow (T5, relative positions: `default`)."""
    config = model.config
    positions = getattr(config, "max_position_embeddings", None)
    if positions is None:
        return default
    if config.model_type in PAD_OFFSET_POSITIONS:  # position ids start after the padding index
        return int(positions) - int(config.pad_token_id) - 1
    return int(positions)


def require_safetensors(model_dir: Path) -> list[Path]:
    """Return the `*.safetensors` weight files of a model directory; never read a pickle one.

    A directory that has pickle weights (`pytorch_model.bin`, `.pt`, `.ckpt`, ...) besides
    safetensors is accepted: only the safetensors files are ever read.

    Raises:
        UnsafeWeightsError: The directory has only pickle weights: unpickling can run arbitrary
            code, so they are never loaded.
        FileNotFoundError: `model_dir` is not a directory, or it has no weights at all.
    """
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir} is not a model directory")
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        return shards
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UnsafeWeightsError(
            f"{model_dir} has only pickle weights {pickles}; pickle can run code when "
            "loaded. Convert them to safetensors where you trust the source, e.g. "
            "`AutoModel.from_pretrained(dir).save_pretrained(new_dir)`, and pass new_dir."
        )
    raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")


def assert_safetensors_only(hf_dir: Path) -> None:
    """Raise `UnsafeWeightsError` if `hf_dir` holds any pickle weight file."""
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UnsafeWeightsError(f"{hf_dir} holds pickle weight files: {pickles}")


def export_layout(hf_dir: Path) -> ExportLayout:
    """How a fine-tuned export is saved: one model, or its base plus a peft or lmpipe adapter.

    `model`: a plain transformers directory. `peft`: `adapter_config.json` and
    `adapter_model.safetensors` beside the base model in `base_model/`. `adapters`: lmpipe's
    bottleneck adapters (`adapters.json`, `adapters.safetensors`) beside `base_model/`.
    """
    if (hf_dir / PEFT_CONFIG_FILE).is_file():
        return "peft"
    if (hf_dir / ADAPTERS_CONFIG_FILE).is_file():
        return "adapters"
    return "model"


def unique_modules_to_save(config: Any) -> None:
    """Drop repeated names from a peft config's `modules_to_save` (in place), keeping the order.

    peft's sequence-classification model appends `classifier` and `score` to the list each time
    it wraps or loads a model, whether or not the list names them already.
    """
    names = getattr(config, "modules_to_save", None)
    if names:
        config.modules_to_save = list(dict.fromkeys(names))


@contextlib.contextmanager
def quiet_load_report() -> Iterator[None]:
    """Keep transformers' LOAD REPORT of weights a load leaves out off the terminal in a block.

    transformers 5 logs the report at WARNING on `transformers.modeling_utils` (a table of
    unexpected and missing keys, e.g. BERT's pooler and sentence-pair head when a masked-LM
    class loads a pretraining export). Only that logger is raised to ERROR for the block and
    restored after it: transformers' other warnings, and its verbosity elsewhere, are untouched.
    A mismatched or unconverted weight still raises.
    """
    logger = transformers.utils.logging.get_logger("transformers.modeling_utils")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def load_peft_export(hf_dir: Path, task_type: str) -> Any:
    """Load a peft adapter export offline, from any working directory: a peft model.

    The base model is loaded from `base_model/` and given to peft, never looked up through the
    adapter's `base_model_name_or_path` (absolute at export, but stale once the directory moves
    without `tasks.common.workspace.open_workspace` re-rooting it). peft appends the task head
    to `modules_to_save` again on load; the loaded config lists each module once.

    Raises:
        UnsafeWeightsError: a pickle weights file, or no `adapter_model.safetensors`.
    """
    import peft  # seconds to import; only adapter exports need it

    assert_safetensors_only(hf_dir)
    if not (hf_dir / PEFT_WEIGHTS_FILE).is_file():
        raise UnsafeWeightsError(f"{hf_dir} has no {PEFT_WEIGHTS_FILE} (no other is read)")
    base_dir = hf_dir / BASE_MODEL_DIR
    require_safetensors(base_dir)
    base = TASK_AUTO_CLASSES[task_type].from_pretrained(
        base_dir, local_files_only=True, use_safetensors=True
    )
    with warnings.catch_warnings():  # peft calls `is_gradient_checkpointing`, a v5 alias
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        # peft reads adapter_model.safetensors when it is there (checked above); it passes
        # `use_safetensors` on unread, stated for the static check of loading calls.
        model = peft.PeftModel.from_pretrained(
            base, str(hf_dir), local_files_only=True, use_safetensors=True
        )
    for config in model.peft_config.values():
        unique_modules_to_save(config)
    return model


def _save_tokenizer(model: PreTrainedModel, tokenizer_dir: Path, dst: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tok.model_max_length = max_length(model, default=tok.model_max_length)
    # transformers 5 records how *this* load happened; an export is not tied to our disk.
    for key in _LOAD_KWARGS:
        tok.init_kwargs.pop(key, None)
    tok.save_pretrained(dst)


def _publish(staged: Path, out_dir: Path) -> None:
    """Move a finished `staged` dir to `out_dir`; an existing export is replaced, not merged."""
    if not out_dir.exists():
        staged.rename(out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
    out_dir.rename(old)
    staged.rename(out_dir)
    shutil.rmtree(old)


def export_model(
    model: PreTrainedModel, tokenizer_dir: Path, out_dir: Path, card: ModelCard
) -> Path:
    """Write `model`, its tokenizer and `card` as a Hugging Face directory at `out_dir`.

    Everything is written into a temporary directory beside `out_dir` and renamed into place,
    so a reader never sees a half-written export. Weights are safetensors only (transformers 5
    `save_pretrained` writes nothing else); generative families get a `generation_config.json`.

    Returns:
        `out_dir`.
    """
    if model.config.model_type != card.family:
        raise ValueError(f"card says {card.family}, model is {model.config.model_type}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        as_stock(model).save_pretrained(staged)  # a fast module saves as its stock class
        if card.family in GENERATIVE and not (staged / "generation_config.json").exists():
            GenerationConfig.from_model_config(model.config).save_pretrained(staged)
        _save_tokenizer(model, tokenizer_dir, staged)
        (staged / "README.md").write_text(render_card(card), encoding="utf-8")
        assert_safetensors_only(staged)
        _publish(staged, out_dir)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    log.info("exported %s-%s to %s", card.family, card.size, out_dir)
    return out_dir


def load_export(
    hf_dir: Path, family: str, task_type: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load an export offline (safetensors only); refuse missing or unexpected keys.

    The Auto class is the family's pretraining one, or the task's for a fine-tuned export
    (`task_type`, one of `tasks.common.schema.DOWNSTREAM_TASK_TYPES`).

    Raises:
        UnsafeWeightsError: The directory has only pickle weights.
        ExportCheckError: The weights do not match the family's model, or the directory is an
            adapter export (load that with `training.finetune.adapters.load_finetuned`).
    """
    layout = export_layout(hf_dir)
    if layout != "model":
        raise ExportCheckError(
            f"{hf_dir} is a {layout} adapter export (its base model is in {BASE_MODEL_DIR}/): "
            "load it with training.finetune.adapters.load_finetuned"
        )
    require_safetensors(hf_dir)  # before transformers looks at the directory at all
    auto = AUTO_CLASSES[family] if task_type is None else TASK_AUTO_CLASSES[task_type]
    model, info = auto.from_pretrained(
        hf_dir, local_files_only=True, use_safetensors=True, output_loading_info=True
    )
    bad = {
        k: v
        for k, v in info.items()
        if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
    }
    if bad:
        raise ExportCheckError(f"{hf_dir} does not match a {family} model: {bad}")
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    return model, tok


def load_serving_model(hf_dir: Path, family: str) -> PreTrainedModel:
    """Load a pretrained export as the class its pipeline serves with (`serving_class`).

    Every weight of that class must come from the export; the export's other heads (BERT's
    sentence-pair head, ELECTRA's replaced-token head) are left out, without transformers'
    load report on the terminal (`quiet_load_report`; the keys are logged at DEBUG).

    Raises:
        UnsafeWeightsError: The directory has only pickle weights.
        ExportCheckError: A weight of the serving class is not in the export.
    """
    require_safetensors(hf_dir)
    cls = getattr(transformers, serving_class(family))
    # transformers reports the left-out heads as unexpected keys: expected here, so not shown.
    with quiet_load_report():
        model, info = cls.from_pretrained(
            hf_dir, local_files_only=True, use_safetensors=True, output_loading_info=True
        )
    log.debug("%s leaves out %s of %s", cls.__name__, sorted(info["unexpected_keys"]), hf_dir)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise ExportCheckError(
            f"{hf_dir} lacks weights of {cls.__name__}: "
            f"{sorted(info['missing_keys'])[:5]} {info['mismatched_keys'][:5]}"
        )
    return model  # type: ignore[no-any-return]


def reload_check(
    out_dir: Path,
    family: str,
    batch: Mapping[str, Tensor],
    expected_loss: float,
    loss_fn: Callable[[PreTrainedModel, Mapping[str, Tensor]], float],
    rtol: float = 1e-4,
) -> float:
    """Reload an export offline and check its loss on a fixed batch matches the trained model.

    Args:
        out_dir: The export.
        family: Model family; picks the Auto class.
        batch: A fixed batch, the same one `expected_loss` was computed on.
        expected_loss: The in-memory model's loss on `batch`, in eval mode.
        loss_fn: Computes the loss of a model on a batch.
        rtol: Relative tolerance.

    Returns:
        The reloaded model's loss.

    Raises:
        ExportCheckError: The loss differs beyond `rtol`, the weights do not match the family's
            model, or the tokenizer has more tokens than the model has embedding rows.
    """
    model, tok = load_export(out_dir, family)
    embeddings = model.get_input_embeddings()
    if not isinstance(embeddings, torch.nn.Embedding):
        raise ExportCheckError(f"input embeddings are a {type(embeddings).__name__}")
    rows = embeddings.num_embeddings
    if len(tok) > rows:
        raise ExportCheckError(f"tokenizer has {len(tok)} tokens, the model {rows} embeddings")
    model.train(False)  # eval mode: no dropout
    with torch.no_grad():
        loss = float(loss_fn(model, batch))
    if not math.isclose(loss, expected_loss, rel_tol=rtol, abs_tol=1e-12):
        raise ExportCheckError(
            f"reloaded loss {loss!r} differs from expected {expected_loss!r} (rtol {rtol})"
        )
    return loss


def load_external_weights(model_dir: Path) -> dict[str, Tensor]:
    """Load a user's model weights from safetensors files only (one file or shards).

    Raises:
        UnsafeWeightsError: The directory holds only pickle weights (`pytorch_model.bin` and
            the like): unpickling can run arbitrary code, so they are never loaded.
        FileNotFoundError: There are no weights at all.
    """
    shards = require_safetensors(model_dir)
    state: dict[str, Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    return state
