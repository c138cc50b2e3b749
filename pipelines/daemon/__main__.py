"""`python -m pipelines.daemon KEY CODE`: the daemon for KEY (the `lmpipe` client starts it)."""

import sys

from pipelines.daemon.server import run

sys.exit(run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""))
