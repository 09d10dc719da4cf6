"""Output shared by the benchmarks: one JSON object on stdout, and in a file when asked, with
the provenance a figure needs to be read later (commit, date, machine, library versions)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from hisr_core.hardware import cpu_name

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def provenance() -> dict[str, Any]:
    """Where and with what a figure was measured: the commit (``dirty`` when the working tree
    had changes), the UTC time, the CPU, its cores, the GPU if any, and library versions."""
    import torch

    status = _git("status", "--porcelain", "--untracked-files=no")
    out: dict[str, Any] = {
        "commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for name in ("transformers", "deepspeed", "vllm"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def emit(result: dict[str, Any], out: Path | None) -> None:
    text = json.dumps({**result, "provenance": provenance()})
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)
