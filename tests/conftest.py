"""Shared fixtures: one real Prefect API server and one MLflow store for the test session."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tasks.runtime import configure_offline
from tests.params_files import write_overlay

configure_offline()  # this process too: Prefect and MLflow clients here tell no one

ROOT = Path(__file__).resolve().parents[1]
# Compiled ops (the decode-attention kernel, DeepSpeed's) are built once for every process of
# the session, whatever directory a test runs in.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))


def pytest_configure(config):
    """Under pytest-xdist (the default, ``-n auto``) each worker's torch, and every process it
    starts, gets its share of the cores: two torch processes of two threads each on a 2-core
    machine slow each other 3-4x, while one thread each overlaps one test's imports and
    server waits with the other's compute."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first (the workers take files in this order), so the run does
    not end with one worker on the whole-pipeline test while the other idles."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PREFECT_", "MLFLOW_", "HISR_"))}


def wait_for_http(url: str, proc: subprocess.Popen, timeout: float, log: Path,
                  what: str) -> None:
    """Wait until ``url`` answers 200; fail with the end of ``log`` if ``proc`` exits first or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start:\n" + log.read_text()[-4000:])
        time.sleep(0.5)


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """Stop a server this test session started: SIGTERM, then SIGKILL after ``grace`` s."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real ``prefect server`` on 127.0.0.1 for the session (flows then start in seconds
    instead of each starting its own temporary server); stopped at the end."""
    home = tmp_path_factory.mktemp("prefect_home")
    port = _free_port()
    env = _clean_env()
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="true", PREFECT_UI_ENABLED="false")
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
         "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_for_http(f"{url}/health", server, 180, home / "server.log", "prefect server")
        yield {"PREFECT_HOME": str(home), "PREFECT_API_URL": url}
    finally:
        stop(server)
        log.close()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One MLflow sqlite store for the session (its schema migration runs once)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def experiment(request) -> str:
    """An MLflow experiment name unique to the test."""
    return "t-" + re.sub(r"[^\w-]", "_", request.node.name)[:60] + f"-{time.monotonic_ns()}"


@pytest.fixture(scope="session")
def run_module(prefect_api):
    """Run ``python -m <module> <args>`` from the project root against the session's servers."""

    def run(module: str, *args: str, timeout: float = 900,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        env = _clean_env()
        env.update(prefect_api, PYTHONPATH=str(ROOT), **(extra_env or {}))
        return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)

    return run


@pytest.fixture
def write_params(tmp_path, mlflow_uri, experiment):
    """Write a params file: an overlay of the project's params.yaml with a few expert tasks,
    the MLflow store of the test run, and ``overrides`` merged over those."""

    def write(overrides: dict | None = None) -> Path:
        small = {"expert": {"n_train": 24, "n_valid_seen": 12, "n_valid_unseen": 12},
                 "tracking": {"mlflow_uri": mlflow_uri, "experiment": experiment}}
        return write_overlay(tmp_path / "params.yaml", small, overrides or {})

    return write
