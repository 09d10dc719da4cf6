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


def _own_servers() -> list:
    """The Prefect API servers (uvicorn child processes) this process started."""
    import sys

    server_module = sys.modules.get("prefect.server.api.server")
    if server_module is None:
        return []  # Prefect never started one here
    return list(server_module.SubprocessASGIServer._instances.values())


def stop_servers() -> None:
    """Stop the Prefect API server this process started (a uvicorn child process). Prefect
    stops it in an ``atexit`` handler, which a signal's default action or ``os._exit`` skips."""
    for server in _own_servers():
        process = server.server_process
        if process is None or process.poll() is not None:
            continue
        process.terminate()
        try:
            process.wait(timeout=3)
        except Exception:  # noqa: BLE001 - it did not stop in time: end it
            process.kill()
            process.wait()


def stop_retrying_own_server() -> None:
    """After a stop signal, report to a Prefect server this process started without retries.

    A signal sent to the whole process group (a batch scheduler, a terminal) ends that server
    too, and Prefect's client would retry every remaining report against it with backoff for
    minutes, far past a scheduler's grace period. The server is a local child process: a refused
    connection will not heal. A server someone else started (``PREFECT_API_URL``) keeps its
    retries."""
    if not _own_servers():
        return
    from prefect.settings.context import get_current_settings

    # Threads without the settings context build their settings from the environment.
    os.environ["PREFECT_CLIENT_MAX_RETRIES"] = "0"
    get_current_settings().client.max_retries = 0


def how_to_resume() -> str:
    """The sentence a stopped stage ends with: the command that resumes it."""
    import shlex
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    command = " ".join([program, *map(shlex.quote, sys.argv[1:])])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "run the same launcher command again to resume"
    return f"run the same command again to resume: {command}"


def handle_stop_signals() -> None:
    """SIGTERM and SIGINT stop this process cleanly (see :mod:`hisr_core.train.preempt`):
    training ends its step and writes a checkpoint, the MLflow run is left KILLED, servers this
    process started are stopped, and the last line says how to resume."""
    from hisr_core.train import preempt

    preempt.install(how_to_resume())
    preempt.on_first_signal(stop_retrying_own_server)
    preempt.on_stop(stop_servers)
