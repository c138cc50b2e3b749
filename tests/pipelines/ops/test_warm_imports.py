"""The training command's early imports (pipelines/ops/warm_imports.py), in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_fresh(code: str) -> str:
    """Run `code` in a new interpreter at the repository root; return its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_the_thread_imports_the_modules_and_the_wait_returns_once_they_are_in() -> None:
    out = run_fresh(
        """
        import sys
        from pipelines.ops import warm_imports as w
        w.warm_imports(("colorsys", "json.tool"))
        w.warm_imports(("wave",))  # once per process: a second call starts nothing
        w.await_warm_imports()
        print("colorsys" in sys.modules, "json.tool" in sys.modules, "wave" in sys.modules)
        """
    )
    assert out == "True True False"


def test_a_module_that_fails_to_import_is_left_to_the_stage_and_the_rest_still_load() -> None:
    out = run_fresh(
        """
        import sys
        from pipelines.ops import warm_imports as w
        w.warm_imports(("no_such_module_anywhere", "colorsys"))
        w.await_warm_imports()
        print("colorsys" in sys.modules)
        """
    )
    assert out == "True"


def test_waiting_without_a_thread_returns_at_once() -> None:
    assert (
        run_fresh(
            "from pipelines.ops import warm_imports as w; w.await_warm_imports(); print('ok')"
        )
        == "ok"
    )


def test_the_data_stages_import_nothing_the_thread_must_finish_first() -> None:
    """The rule the module relies on: until a training stage waits for the thread, this
    thread imports no torch (the data stages' modules and the flows' steps do not)."""
    out = run_fresh(
        """
        import sys
        import pipelines.flows.steps, pipelines.flows.pretrain_flow
        import pipelines.flows.finetune_flow, pipelines.flows.evaluate_flow
        from transformers import PreTrainedTokenizerFast
        print("torch" in sys.modules)
        """
    )
    assert out == "False"
