"""Params files for the tests: the project's ``params.yaml`` with a test's small overrides over
it (merged as a profile is, :func:`hisr_core.config.merge_params`), so every stage a test runs
gets the pipeline's values except the few it shrinks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hisr_core.config import BASE_KEY, merge_params

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PARAMS = ROOT / "params.yaml"


def over_project(*overrides: dict[str, Any]) -> dict[str, Any]:
    """The whole of ``params.yaml`` with each of ``overrides`` merged over it in turn."""
    params = yaml.safe_load(PROJECT_PARAMS.read_text())
    for layer in overrides:
        params = merge_params(params, layer)
    return params


def write_overlay(path: Path, *overrides: dict[str, Any]) -> Path:
    """Write ``path`` as an overlay of the project's ``params.yaml`` listing only
    ``overrides`` (merged in turn): flows load it as they load a profile."""
    merged: dict[str, Any] = {}
    for layer in overrides:
        merged = merge_params(merged, layer)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({BASE_KEY: str(PROJECT_PARAMS), **merged}, sort_keys=False))
    return path
