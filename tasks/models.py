"""Model checks shared by the stages that load a policy."""

from __future__ import annotations

from pathlib import Path

from hisr_core.agent.models import check_model_source  # noqa: F401  (re-exported for the flows)


def check_model_dir(path: Path) -> None:
    """Fail early unless ``path`` is a saved Hugging Face model folder."""
    if not path.is_dir():
        raise ValueError(f"model folder {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
