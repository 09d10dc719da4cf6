"""Typed, validated parameters: one model per ``params.yaml`` section.

Every flow calls :func:`load_params` before doing any work. Unknown keys, wrong types and
out-of-range values raise :class:`ParamsError` with one message that names each offending key
(and, for an unknown key, the nearest valid one), so a typo never silently falls back to a
default.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ParamsError(ValueError):
    """``params.yaml`` is missing, unreadable or invalid; the message names the key."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, fields are documented, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class EnvParams(Section):
    """The benchmark every stage plays."""

    name: str = "household"
    """Registry name of the environment (``household``; later ``alfworld``, ``virtualhome``)."""

    max_turns: int = Field(40, ge=1, le=1000)
    """Turn limit of an episode; the episode ends unsuccessfully when it is reached."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Environment-specific options, checked by the environment (household: ``show_admissible``)."""


class ExpertParams(Section):
    """The ``expert`` stage: task lists of every split and the expert trajectories ``D_bc``."""

    seed: int = Field(0, ge=0)
    """Seed of task generation; the same seed gives byte-identical task and ``D_bc`` files."""

    n_train: int = Field(2000, ge=1, le=1_000_000)
    """Number of training tasks (the expert plays each once; successes form ``D_bc``)."""

    n_valid_seen: int = Field(200, ge=0, le=1_000_000)
    """Number of ``valid_seen`` tasks (new seeds, same vocabulary as train)."""

    n_valid_unseen: int = Field(200, ge=0, le=1_000_000)
    """Number of ``valid_unseen`` tasks (combinations and layouts never in train)."""

    def split_sizes(self) -> dict[str, int]:
        return {
            "train": self.n_train,
            "valid_seen": self.n_valid_seen,
            "valid_unseen": self.n_valid_unseen,
        }


class TrackingParams(Section):
    """Where MLflow records runs."""

    mlflow_uri: str = "sqlite:///data/mlflow/mlflow.db"
    """MLflow tracking URI; a relative ``sqlite:///`` or file path is relative to the project root."""

    experiment: str = Field("hisr", min_length=1)
    """MLflow experiment name; one run per stage."""

    @field_validator("mlflow_uri")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        if "@" in v.split("//", 1)[-1].split("/", 1)[0]:
            raise ValueError("must not contain credentials; set MLFLOW_TRACKING_USERNAME/PASSWORD")
        return v


class Params(Section):
    """The whole ``params.yaml``."""

    env: EnvParams = Field(default_factory=EnvParams)
    """The environment (benchmark) and its turn limit."""

    expert: ExpertParams = Field(default_factory=ExpertParams)
    """Expert task generation and ``D_bc``."""

    tracking: TrackingParams = Field(default_factory=TrackingParams)
    """MLflow tracking."""


def _allowed_keys(model: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """Field names valid at ``loc`` (the location of an unknown key's parent)."""
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        current = annotation
    return list(current.model_fields)


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(Params, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.5)
            hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
            lines.append(f"unknown key {key!r}{hint} (valid here: {', '.join(allowed)})")
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return f"{source}: invalid parameters:\n  " + "\n  ".join(lines)


def parse_params(data: Any, source: str = "params") -> Params:
    """Validate an already-loaded mapping; raises :class:`ParamsError`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamsError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
    try:
        return Params.model_validate(data)
    except ValidationError as err:
        raise ParamsError(_format_errors(err, source)) from None


def load_params(path: str | Path) -> Params:
    """Read and validate ``params.yaml``; raises :class:`ParamsError` naming what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ParamsError(f"{path}: cannot read parameters file ({err.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    return parse_params(data, str(path))


def section_dict(section: BaseModel) -> dict[str, Any]:
    """A section as plain JSON-able data (for cache keys and MLflow params)."""
    return section.model_dump(mode="json")
