"""The heavy imports of a training command, started in a thread while its data stages run.

`lmpipe pretrain` (and `run`, `finetune`, `compare`, `evaluate`) imports torch, DeepSpeed and
MLflow at its training stage: about 3.5 s on a 2-core machine, after the data stages, before
its first step. The command daemon imports MLflow at its first idle moment (`LATER_MODULES` in
pipelines/daemon/child.py), too late for its first command, and never torch or DeepSpeed (a
process that forks commands must not have touched a GPU). So each training command starts them
in a thread of its own as it begins (a module already in is skipped at no cost), and they load
while the Prefect API starts and the data stages run.

The main thread must not import torch (or anything that does) while the thread may still be
importing it: two threads entering a package's circular imports at different modules can
deadlock, which Python reports as an import error. So a training stage calls
`await_warm_imports` before its first torch import; the data stages import none of them but
MLflow, whose import both threads enter at the package itself (the second waits for the
first). docs/cli.md, "Start-up".
"""

from __future__ import annotations

import importlib
import logging
import threading

log = logging.getLogger(__name__)

#: What a training command imports, in the order the thread imports them: MLflow first (the
#: first data stage's run needs it), then torch, DeepSpeed, and the parts of torch that
#: transformers' modeling module loads (about 1 s of its 1.3 s).
TRAINING_MODULES = (
    "mlflow",
    "torch",
    "deepspeed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch._dynamo",
)

_THREAD: list[threading.Thread] = []


def warm_imports(modules: tuple[str, ...] = TRAINING_MODULES) -> None:
    """Start importing `modules` in a daemon thread (once per process; later calls return)."""
    if _THREAD:
        return
    thread = threading.Thread(target=_import_all, args=(modules,), name="lmpipe-imports")
    thread.daemon = True  # an import never holds the command's exit
    _THREAD.append(thread)
    thread.start()


def await_warm_imports() -> None:
    """Wait for the thread `warm_imports` started, if any (a no-op once it has finished)."""
    if _THREAD:
        _THREAD[0].join()


def _import_all(modules: tuple[str, ...]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the stage's own import raises it where it is needed
            log.debug("warm import of %s failed: %s", name, exc)
