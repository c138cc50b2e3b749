#!/usr/bin/env bash
# The work-pool route for lmpipe's Prefect deployments (prefect.yaml at the repository root).
#
#   PREFECT_API_URL=http://127.0.0.1:4200/api bash infra/prefect/work-pool.sh
#
# 1. creates the `process` work pool `lmpipe-process` (idempotent),
# 2. deploys every deployment of prefect.yaml (pipeline + one per stage, with their schedules),
# 3. with LMPIPE_NOTIFY_BLOCK=<block-type-slug>/<name> (e.g. slack-webhook/ops), creates or
#    updates the automation that notifies on failed or crashed lmpipe flow runs,
# 4. starts a worker that runs their flow runs as subprocesses, one at a time by default
#    (LMPIPE_WORKER_LIMIT). It stays in the foreground: stop it with Ctrl-C, or run it under
#    your service manager. Deployments show NOT_READY until a worker polls the pool.
#
# Run from the repository root, with the project's virtual environment (make setup).
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV_BIN="${VENV_BIN:-.venv/bin}"
POOL="${LMPIPE_WORK_POOL:-lmpipe-process}"
LIMIT="${LMPIPE_WORKER_LIMIT:-1}"

: "${PREFECT_API_URL:?set PREFECT_API_URL to your Prefect server, e.g. http://127.0.0.1:4200/api}"
export PREFECT_API_URL RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

if ! "$VENV_BIN/prefect" work-pool inspect "$POOL" >/dev/null 2>&1; then
  "$VENV_BIN/prefect" work-pool create "$POOL" --type process
fi
"$VENV_BIN/prefect" --no-prompt deploy --all
if [[ -n "${LMPIPE_NOTIFY_BLOCK:-}" ]]; then
  "$VENV_BIN/lmpipe" notify "$LMPIPE_NOTIFY_BLOCK"
fi
exec "$VENV_BIN/prefect" worker start --pool "$POOL" --type process --limit "$LIMIT"
