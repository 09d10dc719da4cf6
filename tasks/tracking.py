"""MLflow and DVC metrics plumbing shared by every stage."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hisr_core.config import Params
from hisr_core.contracts import write_json
from tasks.files import write_csv


def _resolve_uri(uri: str) -> str:
    """Make a relative sqlite or file URI absolute (against the working directory)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        db = Path(uri.removeprefix("sqlite:///")).resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{db}"
    if "://" not in uri:
        return Path(uri).resolve().as_uri()
    return uri


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (MLflow params and DVC-style keys)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


@contextlib.contextmanager
def stage_run(params: Params, stage: str, sections: Mapping[str, Any],
              tags: Mapping[str, str] | None = None, resume: str | None = None) -> Iterator[Any]:
    """An MLflow run named ``stage`` with ``sections`` logged as params (and ``tags``), or the
    existing run ``resume`` continued (a stage restarted from its checkpoint).

    The experiment's artifacts live beside a local tracking database (``.../artifacts``).
    A pipeline run sets ``HISR_PARENT_RUN_ID`` so every stage nests under it.
    """
    import mlflow

    uri = _resolve_uri(params.tracking.mlflow_uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.get_experiment_by_name(params.tracking.experiment)
    if experiment is None:
        artifacts = None
        if uri.startswith("sqlite:///"):
            artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "artifacts").as_uri()
        mlflow.create_experiment(params.tracking.experiment, artifact_location=artifacts)
    mlflow.set_experiment(params.tracking.experiment)
    if resume is not None:
        with mlflow.start_run(run_id=resume) as run:
            yield run
        return
    parent = os.environ.get("HISR_PARENT_RUN_ID")
    all_tags = {"hisr.stage": stage, **({"mlflow.parentRunId": parent} if parent else {}),
                **(tags or {})}
    with mlflow.start_run(run_name=stage, tags=all_tags) as run:
        mlflow.log_params({k: json.dumps(v) if not isinstance(v, str) else v
                           for k, v in flatten(sections).items()})
        yield run


def log_metrics(metrics: Mapping[str, Any], path: str | Path | None = None) -> None:
    """Log numeric metrics (nested keys joined by ``/``) to the active run; write ``path`` too."""
    import mlflow

    flat = {k.replace(".", "/"): float(v) for k, v in flatten(metrics).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
    mlflow.log_metrics(flat)
    if path is not None:
        write_json(metrics, path)
        mlflow.log_artifact(str(path))


class LossCurve:
    """An ``on_log`` callback for :func:`hisr_core.fit.fit`: logs each step's metrics to the
    MLflow run ``run_id`` (if any) and keeps ``(step, loss)`` for a DVC plot."""

    def __init__(self, name: str, run_id: str | None) -> None:
        self.name, self.run_id = name, run_id
        self.points: list[tuple[int, float]] = []

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        self.points.append((step, metrics[f"losses/{self.name}"]))
        if self.run_id is not None:
            import mlflow

            mlflow.log_metrics(metrics, step=step, run_id=self.run_id)

    def write_csv(self, path: Path) -> None:
        """``step,loss`` rows, written atomically."""
        write_csv(path, [("step", "loss"), *self.points])
