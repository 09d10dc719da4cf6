"""A fingerprint of input files, shared by training checkpoints and the MLflow run a restarted
stage continues: both must tell "the same inputs" from "other inputs".

By content, not modification time: DVC rewrites an unchanged output when it restores a stage
from its run cache (a `dvc repro` after `git checkout`), and a stopped run must still resume
on the same bytes. Reading a model's bytes costs about what loading it costs, once a start.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def file_stamp(inputs: Sequence[Path | str]) -> list[tuple[str, int, str]]:
    """``(path, size, SHA-256 of the bytes)`` of every file in ``inputs`` (files, or folders
    walked), in path order; a path that does not exist adds nothing."""
    files = sorted(p for path in map(Path, inputs)
                   for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    out = []
    for p in files:
        with p.open("rb") as f:
            out.append((str(p), p.stat().st_size, hashlib.file_digest(f, "sha256").hexdigest()))
    return out


def fingerprint(config: Any, inputs: Sequence[Path | str] = ()) -> str:
    """SHA-256 of ``config`` (JSON-able) and the :func:`file_stamp` of ``inputs``."""
    blob = json.dumps([config, file_stamp(inputs)], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
