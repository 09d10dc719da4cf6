"""A cheap fingerprint of input files, shared by training checkpoints and the MLflow run a
restarted stage continues: both must tell "the same inputs" from "other inputs" without
reading a model of many GB."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def file_stamp(inputs: Sequence[Path | str]) -> list[tuple[str, int, int]]:
    """``(path, size, mtime_ns)`` of every file in ``inputs`` (files, or folders walked), in
    path order; a path that does not exist adds nothing."""
    files = sorted(p for path in map(Path, inputs)
                   for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def fingerprint(config: Any, inputs: Sequence[Path | str] = ()) -> str:
    """SHA-256 of ``config`` (JSON-able) and the :func:`file_stamp` of ``inputs``."""
    blob = json.dumps([config, file_stamp(inputs)], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
