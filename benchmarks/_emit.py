"""Output shared by the benchmarks: one JSON object on stdout, and in a file when asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(result)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
