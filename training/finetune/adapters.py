"""Parameter-efficient modules: bottleneck adapters (ours), the peft LoRA/prompt pieces, exports.

A bottleneck adapter (Houlsby et al. 2019; Pfeiffer et al. 2020) is `h + up(act(down(h)))` with
`up` initialised to zero, so a model with fresh adapters computes exactly what it computed
before. `add_adapters` puts one after the attention output projection and/or the feed-forward
output projection of every layer of a BERT, RoBERTa, GPT-2, Llama or T5 model: the adapter is a
child module of that projection (`.bottleneck_adapter`) applied by a forward hook, so no
parameter of the model is renamed or wrapped. Written here: the `adapters` library pins an older
transformers.

An adapter export keeps the frozen base model in `base_model/` and the adapter beside it: peft's
`adapter_config.json` + `adapter_model.safetensors` (`save_peft_export`, LoRA and prompt tuning),
or lmpipe's `adapters.json` + `adapters.safetensors` (`save_adapters`). `load_finetuned` loads
any fine-tuned export, adapters applied, from any working directory. Also here: the LoRA and
prompt-tuning settings and the peft task type of a model. Not here: which parameters train and
at what lr (`training/finetune/strategies.py`); the layout names (`training/models/export.py`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from training.finetune.config import AdapterConfig as AdapterConfig
from training.finetune.config import LoraSettings as LoraSettings
from training.finetune.config import PromptSettings as PromptSettings
from training.models.export import (
    ADAPTERS_CONFIG_FILE,
    BASE_MODEL_DIR,
    TASK_AUTO_CLASSES,
    assert_safetensors_only,
    export_layout,
    load_peft_export,
    require_safetensors,
    unique_modules_to_save,
)

ADAPTER_ATTR = "bottleneck_adapter"
_HOOK_ATTR = "_bottleneck_adapter_hook"
WEIGHTS_FILE = "adapters.safetensors"
CONFIG_FILE = ADAPTERS_CONFIG_FILE
FORMAT = "lmpipe-bottleneck-adapters/1"

# Per family: the word before a layer's index, and the output projection of each sub-layer.
# T5 decoder blocks have cross-attention too; both attention outputs get an adapter.
_LAYER = r"(?P<layer>(?:.*\.)?{word}\.\d+)"
_SITES: dict[str, tuple[str, dict[str, str]]] = {
    "bert": ("layer", {"attention": r"\.attention\.output\.dense", "ffn": r"\.output\.dense"}),
    "roberta": ("layer", {"attention": r"\.attention\.output\.dense", "ffn": r"\.output\.dense"}),
    "gpt2": ("h", {"attention": r"\.attn\.c_proj", "ffn": r"\.mlp\.c_proj"}),
    "llama": ("layers", {"attention": r"\.self_attn\.o_proj", "ffn": r"\.mlp\.down_proj"}),
    "t5": (
        "block",
        {
            "attention": r"\.layer\.\d+\.(?:SelfAttention|EncDecAttention)\.o",
            "ffn": r"\.layer\.\d+\.(?:DenseReluDense|DenseGatedActDense)\.wo",
        },
    ),
    # ALBERT's layers are shared: one adapter per shared layer, used at every depth.
    "albert": ("albert_layers", {"attention": r"\.attention\.dense", "ffn": r"\.ffn_output"}),
    "distilbert": ("layer", {"attention": r"\.attention\.out_lin", "ffn": r"\.ffn\.lin2"}),
    "bart": ("layers", {"attention": r"\.(?:self_attn|encoder_attn)\.out_proj", "ffn": r"\.fc2"}),
    "mistral": ("layers", {"attention": r"\.self_attn\.o_proj", "ffn": r"\.mlp\.down_proj"}),
    # Mixtral's experts are fused 3-D tensors, not a Linear: attention sites only.
    "mixtral": ("layers", {"attention": r"\.self_attn\.o_proj"}),
}
_SITES |= {
    family: _SITES["bert"]
    for family in ("electra", "deberta-v2", "xlm-roberta", "longformer", "big_bird")
}
_ACTIVATIONS: dict[str, type[torch.nn.Module]] = {
    "relu": torch.nn.ReLU,
    "gelu": torch.nn.GELU,
    "silu": torch.nn.SiLU,
    "tanh": torch.nn.Tanh,
}


class BottleneckAdapter(torch.nn.Module):
    """`h + up(act(down(h)))`, the identity at initialisation (`up` is all zeros)."""

    def __init__(self, hidden: int, width: int, activation: str) -> None:
        """Down-project `hidden` to `width`, apply `activation`, up-project back to zeros."""
        super().__init__()
        self.down = torch.nn.Linear(hidden, width)
        self.act = _ACTIVATIONS[activation]()
        self.up = torch.nn.Linear(width, hidden)
        torch.nn.init.zeros_(self.up.weight)
        torch.nn.init.zeros_(self.up.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Add the bottleneck's output to `hidden` (B, T, D) -> (B, T, D)."""
        update: torch.Tensor = self.up(self.act(self.down(hidden)))  # (B, T, D)
        return hidden + update


def _apply_adapter(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    # Module-level and reading the adapter off `module`: a deep copy of the model then runs
    # its own adapter, not the original's.
    adapter: BottleneckAdapter = getattr(module, ADAPTER_ATTR)
    adapted: torch.Tensor = adapter(output)
    return adapted


def family_of_model(model: torch.nn.Module) -> str:
    """The model's `config.model_type` (bert, roberta, gpt2, llama, t5, ...)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", type(model).__name__))


def adapter_sites(model: torch.nn.Module, placement: str) -> list[str]:
    """The output projections that get an adapter, one or more in every layer.

    Raises:
        ValueError: the family is not supported, or some layer has no site of a placement.
    """
    family = family_of_model(model)
    if family not in _SITES:
        raise ValueError(f"adapters support the families {sorted(_SITES)}, not {family!r}")
    word, patterns = _SITES[family]
    kinds = ("attention", "ffn") if placement == "both" else (placement,)
    names = [name for name, _ in model.named_modules()]
    layers = {n for n in names if re.fullmatch(_LAYER.format(word=word), n)}
    sites: list[str] = []
    for kind in kinds:
        if kind not in patterns:
            raise ValueError(
                f"{family} has no {kind} adapter site (its feed-forward is a mixture of "
                "experts); use adapter placement attention"
            )
        pattern = re.compile(_LAYER.format(word=word) + patterns[kind])
        found = [(n, m) for n in names if (m := pattern.fullmatch(n))]
        missing = sorted(layers - {m.group("layer") for _, m in found})
        if missing or not layers:
            raise ValueError(f"no {kind} output projection found for {family} layers {missing}")
        sites += [n for n, _ in found]
    return sorted(sites, key=names.index)


def _host_weight(module: torch.nn.Module, site: str) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise ValueError(f"{site} ({type(module).__name__}) has no 2-D weight")
    return weight


def attach_adapter(model: torch.nn.Module, site: str, cfg: AdapterConfig) -> BottleneckAdapter:
    """Insert a fresh adapter after the module `site` of `model`; return it."""
    host = model.get_submodule(site)
    if hasattr(host, ADAPTER_ATTR):
        raise ValueError(f"{site} already has an adapter")
    weight = _host_weight(host, site)
    # Conv1D (GPT-2) stores (in, out); Linear stores (out, in).
    hidden = int(weight.shape[1] if isinstance(host, Conv1D) else weight.shape[0])
    adapter = BottleneckAdapter(hidden, cfg.width(hidden), cfg.activation)
    adapter.to(device=weight.device, dtype=weight.dtype)
    host.add_module(ADAPTER_ATTR, adapter)
    setattr(host, _HOOK_ATTR, host.register_forward_hook(_apply_adapter))
    return adapter


def add_adapters(model: torch.nn.Module, cfg: AdapterConfig) -> dict[str, BottleneckAdapter]:
    """Insert adapters in every layer of `model` (in place); site name -> adapter."""
    return {site: attach_adapter(model, site, cfg) for site in adapter_sites(model, cfg.placement)}


def find_adapters(model: torch.nn.Module) -> dict[str, BottleneckAdapter]:
    """The adapters attached to `model`, by site name."""
    return {
        name: module
        for name, parent in model.named_modules()
        if isinstance(module := getattr(parent, ADAPTER_ATTR, None), BottleneckAdapter)
    }


def remove_adapters(model: torch.nn.Module) -> dict[str, BottleneckAdapter]:
    """Detach every adapter (hooks and modules) from `model`; return them by site name."""
    found = find_adapters(model)
    for site in found:
        host = model.get_submodule(site)
        getattr(host, _HOOK_ATTR).remove()
        delattr(host, _HOOK_ATTR)
        delattr(host, ADAPTER_ATTR)
    return found


def save_adapters(
    adapters: dict[str, BottleneckAdapter], cfg: AdapterConfig, directory: Path
) -> list[Path]:
    """Write `adapters.safetensors` (site.down.weight, ...) and `adapters.json` to `directory`."""
    if not adapters:
        raise ValueError("no adapters to save")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {  # named as in the model's own state dict
        f"{site}.{ADAPTER_ATTR}.{key}": value.detach().contiguous().cpu()
        for site, adapter in adapters.items()
        for key, value in adapter.state_dict().items()
    }
    weights, meta = directory / WEIGHTS_FILE, directory / CONFIG_FILE
    save_file(tensors, str(weights), metadata={"format": FORMAT})
    record = {"format": FORMAT, "config": cfg.model_dump(), "sites": list(adapters)}
    meta.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return [weights, meta]


def read_adapter_config(directory: Path) -> tuple[AdapterConfig, list[str]]:
    """The adapter config and site names recorded in `directory/adapters.json`.

    Raises:
        FileNotFoundError: there is no `adapters.json`.
        ValueError: naming the file and the key that is wrong.
    """
    meta = directory / CONFIG_FILE
    record = json.loads(meta.read_text(encoding="utf-8"))
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{meta}: key 'format' must be {FORMAT!r}")
    try:
        cfg = AdapterConfig.model_validate(record.get("config"))
    except ValidationError as err:
        raise ValueError(f"{meta}: key 'config' is invalid: {err}") from err
    sites = record.get("sites")
    if not isinstance(sites, list) or not sites or not all(isinstance(s, str) for s in sites):
        raise ValueError(f"{meta}: key 'sites' must be a non-empty list of module names")
    return cfg, sites


def load_adapters(model: torch.nn.Module, directory: Path) -> dict[str, BottleneckAdapter]:
    """Re-attach the adapters saved in `directory` to `model` (loaded from the same export).

    Raises:
        ValueError: a recorded site is not a module of `model`, or the weights file misses,
            adds or reshapes a tensor (each named with the file).
    """
    cfg, sites = read_adapter_config(directory)
    names = {name for name, _ in model.named_modules()}
    for site in sites:
        if site not in names:
            raise ValueError(f"{directory / CONFIG_FILE}: site {site!r} is not in the model")
    adapters = {site: attach_adapter(model, site, cfg) for site in sites}
    weights = directory / WEIGHTS_FILE
    tensors = load_file(str(weights))
    expected = {
        f"{site}.{ADAPTER_ATTR}.{key}": value
        for site, adapter in adapters.items()
        for key, value in adapter.state_dict().items()
    }
    if tensors.keys() != expected.keys():
        missing, extra = (
            sorted(expected.keys() - tensors.keys()),
            sorted(tensors.keys() - expected.keys()),
        )
        remove_adapters(model)
        raise ValueError(f"{weights}: missing tensors {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for key, target in expected.items():
            if target.shape != tensors[key].shape:
                remove_adapters(model)
                raise ValueError(
                    f"{weights}: {key} has shape {tuple(tensors[key].shape)}, "
                    f"the model needs {tuple(target.shape)}"
                )
            target.copy_(tensors[key])
    return adapters


# --- peft: LoRA and prompt-tuning settings, the soft prompt saved beside an export ----------

LORA_TARGETS = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "gpt2": ["c_attn"],
    "llama": ["q_proj", "v_proj"],
    "t5": ["q", "v"],
    "albert": ["query", "value"],
    "distilbert": ["q_lin", "v_lin"],
    "electra": ["query", "value"],
    "deberta-v2": ["query_proj", "value_proj"],
    "xlm-roberta": ["query", "value"],
    "longformer": ["query", "value"],
    "big_bird": ["query", "value"],
    "bart": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"],
}
_TASKS = (
    ("ForSequenceClassification", "SEQ_CLS"),
    ("ForTokenClassification", "TOKEN_CLS"),
    ("ForQuestionAnswering", "QUESTION_ANS"),
    ("ForConditionalGeneration", "SEQ_2_SEQ_LM"),
    ("ForCausalLM", "CAUSAL_LM"),
    ("LMHeadModel", "CAUSAL_LM"),
)


def peft_task_type(model: torch.nn.Module) -> str:
    """The peft task type of a transformers task class (SEQ_CLS, TOKEN_CLS, ...)."""
    cls = type(model).__name__
    for suffix, task in _TASKS:
        if cls.endswith(suffix):
            return task
    raise ValueError(f"{cls} is no task class peft supports ({[s for s, _ in _TASKS]})")


def load_peft() -> Any:
    """The `peft` module, imported on first use."""
    # peft imports transformers' DeepSpeed integration, accelerate and a model module (several
    # seconds): every `lmpipe` command would pay for it at start, though only LoRA and prompt
    # tuning use it.
    import peft

    return peft


def quiet_peft(build: Any, *args: Any) -> Any:
    """Call a peft function with the transformers 5 deprecation it triggers silenced."""
    with warnings.catch_warnings():  # peft calls `is_gradient_checkpointing`, a v5 alias
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        return build(*args)


def restore_original_modules(model: torch.nn.Module) -> torch.nn.Module:
    """Put the original (untrained) module of each peft `modules_to_save` copy back (in place)."""
    wrapper_type = load_peft().utils.ModulesToSaveWrapper
    wrappers = [n for n, m in model.named_modules() if isinstance(m, wrapper_type)]
    for name in wrappers:
        parent_name, _, child = name.rpartition(".")
        original = model.get_submodule(name).original_module
        setattr(model.get_submodule(parent_name), child, original)
    return model


def peft_base_model(model: Any) -> PreTrainedModel:
    """The base of a peft model as it was before fine-tuning (takes the peft model apart).

    LoRA layers are removed unmerged, and every task head trained as `modules_to_save` gets its
    original module back: the trained head is in the adapter file.
    """
    restore_original_modules(model.get_base_model())
    if model.peft_config["default"].is_prompt_learning:
        return model.get_base_model()  # type: ignore[no-any-return]
    return quiet_peft(model.unload)  # type: ignore[no-any-return]


def save_peft_export(model: Any, directory: Path, home: Path | None = None) -> list[Path]:
    """Write a peft model as an adapter directory with its base model inside; return the files.

    `adapter_config.json` and `adapter_model.safetensors` (LoRA or the soft prompt, plus the
    trained task head) at the top, the frozen base in `base_model/`, and a copy of its
    `config.json` at the top with no weights beside it (a plain `from_pretrained` of the
    directory fails instead of loading the model without its adapter). Takes the model apart.

    Args:
        model: The trained peft model.
        directory: Where to write.
        home: Where the directory is read from once in place (default `directory`): the
            adapter's `base_model_name_or_path` is `<home>/base_model`, absolute.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = model.peft_config["default"]
    # Absolute: `AutoPeftModelFor<Task>` resolves a relative path against the working directory,
    # not the adapter's, so only an absolute one loads from anywhere. A moved workspace
    # rewrites it (`tasks.common.workspace.open_workspace`); `load_finetuned` and the registry
    # pass the base model explicitly and never read it.
    config.base_model_name_or_path = os.path.join(
        os.path.abspath(home or directory), BASE_MODEL_DIR
    )
    unique_modules_to_save(config)
    # The whole base is saved beside it: no embedding copies (peft's "auto" asks the hub).
    save = functools.partial(model.save_pretrained, save_embedding_layers=False)
    quiet_peft(save, str(directory))
    (directory / "README.md").unlink(missing_ok=True)  # peft's card template; the run writes one
    base = peft_base_model(model)
    base.save_pretrained(directory / BASE_MODEL_DIR)
    shutil.copyfile(directory / BASE_MODEL_DIR / "config.json", directory / "config.json")
    return sorted(p for p in directory.rglob("*") if p.is_file())


def load_finetuned(directory: Path, task_type: str) -> torch.nn.Module:
    """Load a fine-tuned export offline with its adapters applied, from any working directory.

    Args:
        directory: A plain export, or an adapter export (`base_model/` plus a peft adapter or
            lmpipe's bottleneck adapters); see `training.models.export.export_layout`.
        task_type: The downstream task type; picks the Auto class.

    Returns:
        The transformers model (bottleneck adapters attached), or a peft model.

    Raises:
        UnsafeWeightsError: a weights file is a pickle, or the peft adapter is not safetensors.
    """
    layout = export_layout(directory)
    if layout == "peft":
        return load_peft_export(directory, task_type)  # type: ignore[no-any-return]
    assert_safetensors_only(directory)
    weights = directory if layout == "model" else directory / BASE_MODEL_DIR
    require_safetensors(weights)
    model: torch.nn.Module = TASK_AUTO_CLASSES[task_type].from_pretrained(
        weights, local_files_only=True, use_safetensors=True
    )
    if layout == "adapters":
        load_adapters(model, directory)
    return model
