"""Untrusted weights never run code: pickle payloads at every import entry point.

A payload is a pickle whose `__reduce__` only creates a marker file under `tmp_path`. It is
planted as `pytorch_model.bin`, as a DeepSpeed shard or RNG file of a checkpoint whose hashes no
longer match its `meta.json`, as tokenizer files, and as the weights of an MLflow registered
model; each real entry point is called and must fail with a clear error while the marker never
appears. `test_payload_is_live` proves the payload does fire when unpickled, so the other tests
can fail. The static checks grep the source for unsafe loading calls.
"""

from __future__ import annotations

import ast
import io
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import GPT2Config, GPT2LMHeadModel

from tasks.tokenizer.tokenizer import PretrainedFiles, TokenizerConfig, load_tokenizer_files
from training.evaluate.stage import EvaluateConfig, evaluate_model
from training.models.export import (
    UnsafeWeightsError,
    load_export,
    load_external_weights,
    reload_check,
)
from training.models.task_models import TaskSpec, load_task_model
from training.runtime import checkpoint as ckpt

pytestmark = [pytest.mark.reliability]

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pipelines", "tasks", "training")


class Payload:
    """Unpickling this creates `marker` (and does nothing else)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (open, (str(self.marker), "x"))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PAYLOAD_RAN"


def plant_torch(path: Path, marker: Path) -> Path:
    """A `torch.save` zip file whose pickle holds the payload among plausible tensors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {"w": torch.zeros(2)}, "hook": Payload(marker)}, path)
    return path


def plant_pickle(path: Path, marker: Path) -> Path:
    """A raw (legacy) pickle of the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(Payload(marker), protocol=2))
    return path


def tiny_gpt2_dir(root: Path, *, safetensors: bool) -> Path:
    """A tiny GPT-2 model directory: config, plus safetensors weights when asked."""
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16)
    if safetensors:
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(root)
    else:
        root.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(root)
    return root


def test_payload_is_live(tmp_path: Path, marker: Path) -> None:
    # The control: loading the planted file the unsafe way does run the payload.
    path = plant_torch(tmp_path / "x.bin", marker)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()


# -- model weights: local HF directories ----------------------------------------------------


def _call_load_external(d: Path) -> object:
    return load_external_weights(d)


def _call_load_task_model(d: Path) -> object:
    return load_task_model(d, TaskSpec(task_type="classification", labels=("a", "b")))


def _call_load_export(d: Path) -> object:
    return load_export(d, "gpt2")


def _call_reload_check(d: Path) -> object:
    return reload_check(d, "gpt2", {}, 0.0, lambda m, b: 0.0)


def _call_evaluate(d: Path) -> object:
    return evaluate_model(d, EvaluateConfig())


MODEL_ENTRY_POINTS = {
    "load_external_weights": _call_load_external,
    "load_task_model (finetune from a local dir)": _call_load_task_model,
    "load_export (register, serve)": _call_load_export,
    "reload_check (lmpipe export)": _call_reload_check,
    "evaluate_model (lmpipe evaluate)": _call_evaluate,
}
PICKLE_NAMES = ("pytorch_model.bin", "model.pt", "model.ckpt", "pytorch_model-00001-of-00002.bin")


@pytest.mark.parametrize("entry", list(MODEL_ENTRY_POINTS))
@pytest.mark.parametrize("name", PICKLE_NAMES)
def test_pickle_only_model_dir_is_refused(
    tmp_path: Path, marker: Path, entry: str, name: str
) -> None:
    model_dir = tiny_gpt2_dir(tmp_path / "model", safetensors=False)
    plant_torch(model_dir / name, marker)
    with pytest.raises(UnsafeWeightsError, match="pickle"):
        MODEL_ENTRY_POINTS[entry](model_dir)
    assert not marker.exists(), f"{entry} unpickled {name}"


@pytest.mark.parametrize(
    "entry", ["load_external_weights", "load_task_model (finetune from a local dir)"]
)
def test_pickle_beside_safetensors_is_never_read(tmp_path: Path, marker: Path, entry: str) -> None:
    model_dir = tiny_gpt2_dir(tmp_path / "model", safetensors=True)
    plant_torch(model_dir / "pytorch_model.bin", marker)
    plant_pickle(model_dir / "training_args.bin", marker)
    MODEL_ENTRY_POINTS[entry](model_dir)  # loads the safetensors weights
    assert not marker.exists()


# -- tokenizers ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tokenizer_json", "vocab_txt", "spm_model", "vocab_json"])
def test_pickled_tokenizer_files_are_refused(tmp_path: Path, marker: Path, kind: str) -> None:
    payload = plant_pickle(tmp_path / "tok" / f"{kind}.bin", marker)
    files = {kind: str(payload)}
    if kind == "vocab_json":
        files["merges"] = str(plant_pickle(tmp_path / "tok" / "merges.bin", marker))
    family = {"vocab_txt": "wordpiece", "spm_model": "unigram", "vocab_json": "bpe"}
    cfg = TokenizerConfig(family=family.get(kind, "wordpiece"))  # type: ignore[arg-type]
    # Each format fails with its own parser's error (tokenizers raises a bare Exception).
    with pytest.raises(Exception) as caught:  # noqa: PT011
        load_tokenizer_files(PretrainedFiles.model_validate(files), cfg)
    assert not isinstance(caught.value, AssertionError)
    assert not marker.exists()


def test_pickled_hf_tokenizer_files_are_not_unpickled(tmp_path: Path, marker: Path) -> None:
    from transformers import AutoTokenizer

    tok_dir = tmp_path / "tok"
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model"):
        plant_pickle(tok_dir / name, marker)
    with pytest.raises(Exception) as caught:  # noqa: PT011 (transformers' parse errors vary)
        AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    assert not isinstance(caught.value, AssertionError)
    assert not marker.exists()


# -- lmpipe's own checkpoints ----------------------------------------------------------------

MODEL_STATES = f"{ckpt.TAG}/mp_rank_00_model_states.pt"
OPTIM_STATES = f"{ckpt.TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt"


def committed_checkpoint(run_dir: Path) -> Path:
    """A committed checkpoint (benign shard and RNG file, then `meta.json`), as training writes."""
    path = run_dir / ckpt.checkpoint_name(2)
    (path / ckpt.TAG).mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}}, path / MODEL_STATES)
    torch.save(ckpt.rng_state(), path / ckpt.rng_file(0))
    ckpt.write_meta(path, {"step": 2, "world_size": 1, "config_hash": "h", "train": {}})
    ckpt.write_latest(run_dir, path)
    return path


TAMPERINGS = {
    "model shard replaced": (MODEL_STATES, plant_torch),
    "rng file replaced": (ckpt.rng_file(0), plant_torch),
    "unlisted optimizer shard added": (OPTIM_STATES, plant_torch),
    "legacy pickle shard": (MODEL_STATES, plant_pickle),
}


@pytest.mark.parametrize("how", list(TAMPERINGS))
def test_tampered_checkpoint_is_never_unpickled(tmp_path: Path, marker: Path, how: str) -> None:
    from pipelines.cli.main import main
    from training.pretrain.stage import export_checkpoint

    run_dir = tmp_path / "run"
    path = committed_checkpoint(run_dir)
    name, plant = TAMPERINGS[how]
    plant(path / name, marker)

    with pytest.raises(ckpt.CheckpointError, match=r"sha256|not in meta"):
        ckpt.validate(path)
    with pytest.raises(ckpt.CheckpointError):
        export_checkpoint(path, tmp_path / "export")
    assert main(["export", str(path), "--out", str(tmp_path / "export2")]) == 2
    assert ckpt.find_resumable(run_dir, path, "h") is None  # resume: nothing loadable
    assert not marker.exists()
    assert not (tmp_path / "export").exists()


def test_checkpoint_without_meta_is_never_unpickled(tmp_path: Path, marker: Path) -> None:
    path = tmp_path / "run" / ckpt.checkpoint_name(4)
    plant_torch(path / MODEL_STATES, marker)
    with pytest.raises(ckpt.CheckpointError, match=r"no meta\.json"):
        ckpt.validate(path)
    assert ckpt.find_resumable(tmp_path / "run", path, None) is None
    assert not marker.exists()


def test_rng_state_round_trips_with_weights_only(tmp_path: Path) -> None:
    # What `training/pretrain/loop.py` restores with `weights_only=False` today loads under
    # `weights_only=True` too (torch 2.13 allows numpy arrays and dtypes), and restores exactly.
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    expected = torch.rand(3)
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected)


# -- the MLflow registry ---------------------------------------------------------------------


def _mlmodel(root: Path, binary: str = "model") -> None:
    flavor = {"model_binary": binary, "components": ["tokenizer"], "task": "text-generation"}
    (root / "MLmodel").write_text(yaml.safe_dump({"flavors": {"transformers": flavor}}))


@pytest.fixture
def planted_registry(tmp_path: Path, marker: Path, mlflow_uri: str) -> tuple[str, str]:
    """A registered model whose files are a transformers flavor with pickle weights."""
    from mlflow import MlflowClient

    art = tmp_path / "artifact"
    tiny_gpt2_dir(art / "model", safetensors=False)
    plant_torch(art / "model" / "pytorch_model.bin", marker)
    (art / "components" / "tokenizer").mkdir(parents=True)
    (art / "components" / "tokenizer" / "tokenizer_config.json").write_text("{}")
    _mlmodel(art)
    client = MlflowClient(mlflow_uri)
    name = f"payload-{tmp_path.name}"
    exp = client.create_experiment(name, artifact_location=(tmp_path / "mlruns").as_uri())
    run = client.create_run(exp)
    client.log_artifacts(run.info.run_id, str(art), "model")
    client.create_registered_model(name)
    version = client.create_model_version(
        name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    )
    client.set_registered_model_alias(name, "candidate", version.version)
    client.set_terminated(run.info.run_id)
    return name, run.info.run_id


@pytest.mark.slow
def test_registry_model_with_pickle_weights_is_refused(
    tmp_path: Path, marker: Path, mlflow_uri: str, planted_registry: tuple[str, str]
) -> None:
    from training.finetune.config import BaseModelRef
    from training.finetune.stage import resolve_base_model
    from training.tracking.registry import (
        Registration,
        download_model,
        register_export,
        resolve_version,
    )

    name, run_id = planted_registry
    ref = resolve_version(mlflow_uri, name, "candidate")
    with pytest.raises(UnsafeWeightsError, match="pickle"):
        download_model(mlflow_uri, ref, tmp_path / "dl")
    assert not (tmp_path / "dl").exists()
    base = BaseModelRef(registry_name=name, version="candidate")
    with pytest.raises(UnsafeWeightsError):  # fine-tuning from `models:/...`
        resolve_base_model(base, mlflow_uri, tmp_path / "ws")
    # Registering a pickle-only directory is refused before anything is logged.
    local = tiny_gpt2_dir(tmp_path / "local", safetensors=False)
    plant_torch(local / "pytorch_model.bin", marker)
    with pytest.raises(UnsafeWeightsError):
        register_export(local, "gpt2", mlflow_uri, run_id, Registration(name, "x"))
    assert not marker.exists()


# -- static checks ---------------------------------------------------------------------------

# Allowed exceptions: (file, enclosing function, call). Each one runs only on a checkpoint
# that `training.runtime.checkpoint.validate` has just hashed against its meta.json.
ALLOWED: set[tuple[str, str, str]] = set()  # every torch.load in the tree is weights_only
_UNSAFE_CALLS = {
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "cloudpickle.load",
    "cloudpickle.loads",
    "dill.load",
    "dill.loads",
    "joblib.load",
    "mlflow.pyfunc.load_model",
    "mlflow.pytorch.load_model",
    "mlflow.transformers.load_model",
    "mlflow.sklearn.load_model",
}
_TOKENIZER_OR_CONFIG = re.compile(r"(Tokenizer|Config|Processor|FeatureExtractor)\w*$")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_loads(source: str, file: str) -> list[tuple[str, str, str]]:
    """(file, function, finding) for every unsafe loading call in `source`."""
    findings = []
    parents: dict[ast.AST, str] = {}
    tree = ast.parse(source)
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for child in ast.walk(fn):
                parents.setdefault(child, fn.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, where = _dotted(node.func), parents.get(node, "<module>")
        if _keyword(node, "trust_remote_code") is not None and not (
            isinstance(_keyword(node, "trust_remote_code"), ast.Constant)
            and getattr(_keyword(node, "trust_remote_code"), "value", None) is False
        ):
            findings.append((file, where, f"{name} trust_remote_code set"))
        if name == "torch.load" and not _is_true(_keyword(node, "weights_only")):
            findings.append((file, where, "torch.load weights_only=False"))
        if name in _UNSAFE_CALLS:
            findings.append((file, where, name))
        if name.endswith(("np.load", "numpy.load")) and _is_true(_keyword(node, "allow_pickle")):
            findings.append((file, where, "np.load allow_pickle=True"))
        if name.endswith(".from_pretrained") and not _TOKENIZER_OR_CONFIG.search(
            name.removesuffix(".from_pretrained")
        ):
            # A model class: safetensors only, never the network.
            if not _is_true(_keyword(node, "use_safetensors")):
                findings.append((file, where, f"{name} without use_safetensors=True"))
            if not _is_true(_keyword(node, "local_files_only")):
                findings.append((file, where, f"{name} without local_files_only=True"))
        if name.endswith(".load_checkpoint") and file != "training/pretrain/loop.py":
            findings.append((file, where, f"{name} outside the validated resume path"))
    return findings


def _sources() -> list[Path]:
    return sorted(p for pkg in SOURCES for p in (REPO / pkg).rglob("*.py"))


def test_static_no_unsafe_loading_in_the_source_tree() -> None:
    findings = []
    for path in _sources():
        text = path.read_text()
        rel = path.relative_to(REPO).as_posix()
        findings += [f for f in unsafe_loads(text, rel) if f not in ALLOWED]
        if re.search(r"trust_remote_code\s*=\s*True", text):
            findings.append((rel, "?", "trust_remote_code=True"))
    assert findings == []


def test_deepspeed_loads_its_pickles_only_behind_validation() -> None:
    # DeepSpeed's load_checkpoint unpickles; it reads a checkpoint that rank 0 chose with
    # find_resumable (every file hashed against meta.json) earlier in `restore`, the one
    # method from which every loading method of the worker is reached.
    tree = ast.parse((REPO / "training/pretrain/loop.py").read_text())
    methods = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    calls = {name: _calls_in_source_order(fn) for name, fn in methods.items()}
    primitives = {"torch.load", "self.engine.load_checkpoint"}
    # The private helpers that load, directly or through another such helper.
    helpers = {m for m, found in calls.items() if primitives & set(found)}
    assert all(m.startswith("_") for m in helpers), helpers
    while more := {
        m
        for m, found in calls.items()
        if m.startswith("_") and m not in helpers and {f"self.{h}" for h in helpers} & set(found)
    }:
        helpers |= more
    loading = primitives | {f"self.{h}" for h in helpers}
    callers = {m for m, found in calls.items() if m not in helpers and loading & set(found)}
    assert callers == {"restore"}, callers
    order = calls["restore"]
    first_load = min(i for i, c in enumerate(order) if c in loading)
    assert "ckpt.find_resumable" in order[:first_load], order


def _calls_in_source_order(fn: ast.FunctionDef) -> list[str]:
    found = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    return [_dotted(n.func) for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


@pytest.mark.parametrize(
    ("snippet", "finding"),
    [
        ("import torch\ntorch.load(p)\n", "torch.load weights_only=False"),
        ("import torch\ntorch.load(p, weights_only=False)\n", "torch.load weights_only=False"),
        ("import pickle\npickle.loads(b)\n", "pickle.loads"),
        ("A.from_pretrained(d, trust_remote_code=True)\n", "trust_remote_code set"),
        ("AutoModel.from_pretrained(d, local_files_only=True)\n", "without use_safetensors"),
        ("import mlflow\nmlflow.pyfunc.load_model(u)\n", "mlflow.pyfunc.load_model"),
    ],
)
def test_static_check_catches_unsafe_snippets(snippet: str, finding: str) -> None:
    found = [f for _, _, f in unsafe_loads(snippet, "x.py")]
    assert any(finding in f for f in found), found


def test_exports_and_downloads_hold_no_pickle(tmp_path: Path) -> None:
    # The registry's download refuses a flattened model with any pickle file, even beside
    # safetensors (an export never writes one).
    from training.models.export import assert_safetensors_only

    model_dir = tiny_gpt2_dir(tmp_path / "m", safetensors=True)
    assert_safetensors_only(model_dir)
    (model_dir / "extra.pt").write_bytes(io.BytesIO(b"x").getvalue())
    with pytest.raises(UnsafeWeightsError):
        assert_safetensors_only(model_dir)
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "gpt2"
