"""Command-line plumbing shared by the stage flows: parse, validate params, fail early."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from hisr_core.config import Params, ParamsError, load_params
from tasks.runtime import handle_stop_signals


def stage_parser(description: str) -> argparse.ArgumentParser:
    """The stage command's parser; from here on SIGTERM and SIGINT are a clean stop."""
    handle_stop_signals()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"),
                        help="parameters file: params.yaml or a profile over it, such as "
                        "profiles/alfworld.yaml (default: params.yaml)")
    parser.add_argument("--data", type=Path, default=Path("data"),
                        help="data folder the stage reads and writes (default: data)")
    # The ``deepspeed`` launcher passes --local_rank; the process reads LOCAL_RANK instead.
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def load_or_exit(path: Path, check: Callable[[Params], None] | None = None) -> Params:
    """Validated params, or a one-message exit with status 2 before any work is done."""
    try:
        params = load_params(path)
        if check is not None:
            check(params)
    except (ParamsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return params


def require(path: Path, stage: str) -> Path:
    """``path`` if it exists, else exit naming the stage that makes it."""
    if not path.exists():
        raise SystemExit(f"error: {path} does not exist; run the {stage} stage first "
                         f"(dvc repro {stage})")
    return path


def require_all(needs: Mapping[Path, str]) -> None:
    """:func:`require` for each input (path → the stage that makes it)."""
    for path, stage in needs.items():
        require(path, stage)
