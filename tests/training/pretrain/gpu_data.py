"""Build what `test_gpu.py` needs on a GPU machine that has no package index.

Usage, here in the dev venv (it starts a local Ray and asks pip's index for wheels):

    .venv/bin/python tests/training/pretrain/gpu_data.py --out .gpudata/tests

OUT/bert/examples and OUT/bert/tokenizer: the demo corpus's BERT examples, cut exactly as the
`demo_data` fixture cuts them (tests/conftest.py). OUT/wheels: the wheels the GPU image lacks
or has at another version (bench/pretrain_data.py's `download_wheels`, which
`bench/pretrain_gpu.py prepare --wheels` calls: pydantic, DeepSpeed, transformers). The image
already has pytest and pytest-timeout. Carry OUT to the GPU machine and run
`make test-gpu-offline` there (docs/testing.md, "GPU tests").
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def build_examples(out: Path) -> None:
    """Cut the demo BERT examples on a local Ray and copy them and their tokenizer to `out`."""
    # The repository before tests/: `tasks` must be the package, not the test folder.
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    # conftest sets Ray's and Prefect's environment first (RAY_AUTH_MODE is read at import).
    from conftest import DemoData

    with tempfile.TemporaryDirectory(prefix="lmpipe-gpu-data-") as tmp:
        built = DemoData(Path(tmp)).examples("bert")
        import ray

        ray.shutdown()
        for part in ("examples", "tokenizer"):
            target = out / "bert" / part
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(built[part], target)


def download_wheels(out: Path) -> list[str]:
    """The GPU benchmark's wheels (the same image runs both) into `out`."""
    sys.path[:0] = [str(REPO), str(REPO / "bench")]  # bench/'s modules import each other so
    from pretrain_data import download_wheels as fetch

    shutil.rmtree(out, ignore_errors=True)
    wheels: list[str] = fetch(out)
    return wheels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Folder to carry (e.g. .gpudata/tests).")
    parser.add_argument("--no-wheels", action="store_true", help="Build the examples only.")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    build_examples(out)
    if not args.no_wheels:
        print("\n".join(download_wheels(out / "wheels")))
    print(f"carry {out} (docs/testing.md, 'GPU tests')")


if __name__ == "__main__":
    main()
