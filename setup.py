"""Build the one C extension, `tasks.ingest._textscan`; all other metadata lives in pyproject.toml.

The SHA-256 of the C source is compiled in, so that `tasks.ingest.textscan` can refuse a stale build
(an edited `_textscan.c` whose module was not rebuilt) instead of silently running old code.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "tasks/ingest/_textscan.c"
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[
        Extension(
            "tasks.ingest._textscan",
            sources=[SOURCE],
            define_macros=[("TEXTSCAN_SOURCE_SHA256", f'"{DIGEST}"')],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        )
    ]
)
