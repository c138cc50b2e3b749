"""The driver pretraining and fine-tuning share: a training run as a stage output.

A training run is planned the way every data stage's output is (`tasks/common/stage.py`): its
key hashes its inputs' fingerprints, its config (less what does not change the result), the
seed and the source of `tasks/` and `training/`, and it lives in `<root>/<key>/`, where root is
`<workspace>/<stage>/` (or pretraining's `train.checkpoint.storage_path`). The directory holds:

- `record.json`, written when the run opens: its upstream outputs (what `lmpipe gc` keeps with
  it) and its MLflow run id (a resumed run logs into the same MLflow run);
- the loop's own files: checkpoints, `steps.jsonl`, `evals.jsonl`, `result.json`, ...;
- `export/`, the Hugging Face export;
- `manifest.json`, written last, once the run finished and was published: the export's files
  and the stage's summary. A complete manifest makes the next call with the same key a reuse.

`RunIdentity` is what keys a run; `RunDirectory` walks one run through the scaffold: `reuse`,
`record`, `open`, `fit` (the launcher, on the typed job), `commit`. What differs between the
stages (how a stopped run continues, the export, the registration) stays in
`training/pretrain/` and `training/finetune/`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tasks.common.io import write_json_atomic
from tasks.common.ray_runtime import RayConfig
from tasks.common.stage import StageOutput, complete_manifest, file_entry, plan_output
from tasks.common.workspace import relocate_record
from training.runtime.config import ScaleConfig
from training.runtime.launcher import fit
from training.runtime.progress import ProgressSpec
from training.runtime.worker_context import Job, LoopEntry

#: The packages whose source a training run's key covers.
RUN_CODE = ("tasks", "training")
RECORD_FILE = "record.json"
EXPORT_DIR = "export"

#: What a run was built from, by name: `{"fingerprint": ..., "path": ...}` each (the shape a
#: data stage's manifest names its upstream outputs in, which `lmpipe gc` follows).
Upstream = dict[str, dict[str, str]]


def upstream_ref(fingerprint: str, path: Path) -> dict[str, str]:
    """One upstream output as a run's record and manifest name it."""
    return {"fingerprint": fingerprint, "path": str(path.resolve())}


def published(summary: dict[str, Any], *, registered: bool) -> bool:
    """Whether a finished run's summary counts as published: registered, when that is asked."""
    return not registered or "model_version" in summary


@dataclass(frozen=True)
class RunIdentity:
    """What keys a training run: its inputs, config and seed, and where the inputs are.

    Attributes:
        stage: `pretrain` or `finetune`.
        inputs: The inputs' fingerprints (paths never: a moved workspace keeps its runs).
        config: The config, less what does not change the result.
        seed: The run seed.
        upstream: The inputs as outputs: fingerprint and path, for the record and manifest.
    """

    stage: str
    inputs: dict[str, Any]
    config: dict[str, Any]
    seed: int
    upstream: Upstream

    def place(self, root: Path, workspace: Path) -> RunDirectory:
        """This run's directory under `root`; `workspace` is where recorded paths are read."""
        out = plan_output(
            self.stage, self.inputs, self.config, path=root, seed=self.seed, code=RUN_CODE
        )
        path = root.resolve() / out.fingerprint
        return RunDirectory(replace(out, path=path), self.upstream, workspace)

    @property
    def key(self) -> str:
        """The run's key: the directory name `place` gives it."""
        return self.place(Path(), Path()).key


@dataclass(frozen=True)
class RunDirectory:
    """One training run's directory, `<root>/<key>/`, and the steps of the scaffold on it."""

    out: StageOutput
    upstream: Upstream
    workspace: Path

    @property
    def path(self) -> Path:
        """The run directory (absolute)."""
        return self.out.path

    @property
    def key(self) -> str:
        """The run's key (its directory's name): the workers' `config_hash`."""
        return self.out.fingerprint

    @property
    def export_dir(self) -> Path:
        """Where the run's Hugging Face export goes."""
        return self.path / EXPORT_DIR

    def reuse(self, *, registered: bool = False) -> dict[str, Any] | None:
        """The summary of a finished, published run here (paths relocated), else None.

        Args:
            registered: Count a run as published only when its export was registered (a run
                published while tracking was off is published again when it is on).
        """
        manifest = self.out.reuse(complete_manifest)
        if manifest is None:
            return None
        summary: dict[str, Any] = relocate_record(manifest["summary"], self.workspace)
        return summary if published(summary, registered=registered) else None

    def record(self) -> dict[str, Any]:
        """What an earlier call recorded on opening this run (`{}` if none)."""
        path = self.path / RECORD_FILE
        if not path.is_file():
            return {}
        record: dict[str, Any] = relocate_record(json.loads(path.read_text()), self.workspace)
        return record

    def open(self, *, keep: bool, mlflow_run_id: str | None) -> None:
        """Create the run directory and write its record.

        Args:
            keep: Keep what an earlier attempt left (a stopped run to resume); else it is
                removed first, so a restart sees no stale checkpoint or Ray state.
            mlflow_run_id: The MLflow run this run logs to, recorded for a later resume.
        """
        if not keep and self.path.is_dir():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        record = {"stage": self.out.stage, "fingerprint": self.key, **self.upstream}
        write_json_atomic(self.path / RECORD_FILE, record | {"mlflow_run_id": mlflow_run_id})

    def fit(
        self,
        entry: LoopEntry[Job],
        job: Job,
        scale: ScaleConfig,
        ray_cfg: RayConfig,
        progress: ProgressSpec | None = None,
    ) -> None:
        """Run `entry`'s loop on `job` in this directory (`training/runtime/launcher.py`)."""
        fit(entry, job, scale, self.path, ray_cfg, progress)

    def commit(self, summary: dict[str, Any]) -> None:
        """Write `manifest.json` last: the export's files, the upstream outputs, the summary."""
        files = sorted(p for p in self.export_dir.rglob("*") if p.is_file())
        entries = [file_entry(self.path, p) for p in files]
        manifest = {**self.out.header(), **self.upstream, "files": entries}
        self.out.commit(manifest | {"summary": summary})
