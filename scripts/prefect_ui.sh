#!/usr/bin/env bash
# Start a local Prefect server (API and UI) on 127.0.0.1, analytics off. In the shell that
# runs the pipeline: export PREFECT_API_URL=http://127.0.0.1:${PORT}/api, then `dvc repro`
# (every stage appears as a flow run) or `python -m flows.serve` (a Run button per stage).
# PORT defaults to 4200; the server's database lives in PREFECT_HOME (default ~/.prefect).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-4200}
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true
echo "Prefect UI: http://127.0.0.1:${PORT}   export PREFECT_API_URL=http://127.0.0.1:${PORT}/api"
exec .venv/bin/prefect server start --host 127.0.0.1 --port "$PORT"
