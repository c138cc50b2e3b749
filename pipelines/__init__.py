"""Prefect flows, the `lmpipe` CLI and the root config.

Ray 2.60 reads `RAY_AUTH_MODE` when `ray` is imported, and every process and client of one cluster
must agree on it (docs/stack.md, "Ray token authentication"): set it here, before any module
of ours imports `ray`.
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")
