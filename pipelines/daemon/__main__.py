"""`python -m pipelines.daemon KEY`: the daemon for KEY (the `lmpipe` client starts it)."""

import sys

from pipelines.daemon.server import run

sys.exit(run(sys.argv[1]))
