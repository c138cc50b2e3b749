"""The compiled text kernels (`tasks/ingest/_textscan.c`), loaded loudly: never a silent fallback.

`kernels` is the extension module. It is built by `pip install -e .` (`make setup`); a missing
or stale build (the C source changed since it was compiled) raises `ImportError` that says so.
What the kernels compute is specified by the pure-Python references they replace:
`tasks.ingest.sentences.split_column_reference` and `tasks.ingest.text.clean_texts_reference`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_SOURCE = Path(__file__).with_name("_textscan.c")
_HOW_TO_BUILD = (
    "run `pip install -e .` (or `make setup`) in the repository root; it compiles "
    "tasks/ingest/_textscan.c with the C compiler and Python headers"
)

try:
    from tasks.ingest import _textscan as kernels
except ImportError as exc:
    raise ImportError(
        f"the compiled text kernels tasks.ingest._textscan are not built ({exc}): {_HOW_TO_BUILD}"
    ) from exc

# Only a source checkout has the C file next to the module; an installed wheel may not.
if _SOURCE.is_file() and hashlib.sha256(_SOURCE.read_bytes()).hexdigest() != kernels.SOURCE_SHA256:
    raise ImportError(
        f"tasks.ingest._textscan ({kernels.__file__}) was built from another version of {_SOURCE}: "
        f"{_HOW_TO_BUILD}"
    )

__all__ = ["kernels"]
