"""Process-wide settings every pipeline run needs before Prefect, MLflow or HF are imported.

The pipeline must run offline and tell no one: telemetry and update checks are switched off
here, for the project's own processes, unless the user has set the variable already.
"""

from __future__ import annotations

import os

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # A busy 2-core machine can take longer than Prefect's default 20 s to start its
    # ephemeral API server.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # `mlflow server` would otherwise start job-execution workers (~2 GB).
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "DVC_NO_ANALYTICS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def configure_offline() -> None:
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
