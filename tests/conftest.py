"""Shared fixtures: isolated Prefect home and a small params file per test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory) -> Path:
    """One Prefect home (ephemeral API database) for the whole test session."""
    return tmp_path_factory.mktemp("prefect_home")


@pytest.fixture
def run_module(prefect_home, tmp_path):
    """Run ``python -m <module> <args>`` from the project root, isolated from the user's setup."""

    def run(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PREFECT_", "MLFLOW_", "HISR_"))}
        env.update(PREFECT_HOME=str(prefect_home), PYTHONPATH=str(ROOT))
        return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture
def write_params(tmp_path):
    """Write a params file: small defaults, tracking inside tmp_path, overrides merged in."""

    def write(overrides: dict | None = None, raw: str | None = None) -> Path:
        path = tmp_path / "params.yaml"
        if raw is not None:
            path.write_text(raw)
            return path
        params = {
            "env": {"name": "household", "max_turns": 40},
            "expert": {"seed": 0, "n_train": 24, "n_valid_seen": 12, "n_valid_unseen": 12},
            "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}",
                         "experiment": "test"},
        }
        for section, values in (overrides or {}).items():
            params.setdefault(section, {}).update(values)
        path.write_text(yaml.safe_dump(params))
        return path

    return write
