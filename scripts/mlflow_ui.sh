#!/usr/bin/env bash
# Start the MLflow UI on 127.0.0.1 over the pipeline's tracking store (tracking.mlflow_uri in
# params.yaml: by default the SQLite database data/mlflow/mlflow.db; MLFLOW_TRACKING_URI wins
# if set). The job-execution workers are off: they would take ~2 GB and the UI does not need
# them. PORT defaults to 5000.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-5000}
STORE=${MLFLOW_TRACKING_URI:-$(.venv/bin/python -c \
  'from hisr_core.config import load_params; print(load_params("params.yaml").tracking.mlflow_uri)')}
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true
echo "MLflow UI: http://127.0.0.1:${PORT}  (store: ${STORE})"
exec .venv/bin/mlflow ui --backend-store-uri "$STORE" --host 127.0.0.1 --port "$PORT"
