"""MLflow and DVC metrics plumbing shared by every stage."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hisr_core.config import Params
from hisr_core.contracts import write_json
from hisr_core.stamp import fingerprint
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


#: Tag of the parent run that every stage run of one pipeline run nests under.
PIPELINE_TAG = "hisr.pipeline"


def use_experiment(params: Params) -> str:
    """Point MLflow at ``MLFLOW_TRACKING_URI`` if set, else ``tracking.mlflow_uri``, and at
    ``tracking.experiment`` (created on first use, its artifacts beside a local tracking
    database); returns the experiment id."""
    import mlflow

    uri = _resolve_uri(os.environ.get("MLFLOW_TRACKING_URI") or params.tracking.mlflow_uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.get_experiment_by_name(params.tracking.experiment)
    if experiment is None:
        artifacts = None
        if uri.startswith("sqlite:///"):
            artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "artifacts").as_uri()
        mlflow.create_experiment(params.tracking.experiment, artifact_location=artifacts)
    return mlflow.set_experiment(params.tracking.experiment).experiment_id


def pipeline_run_id(params: Params, create: bool = True) -> str | None:
    """The parent run of the pipeline run in progress: ``HISR_PARENT_RUN_ID`` when set (the
    ``pipeline`` flow sets it), else the newest unfinished run tagged ``hisr.pipeline`` (so
    every stage of one ``dvc repro`` nests under one parent, and a ``dvc repro`` after a crash
    continues it), else a new one when ``create``. The ``report`` stage finishes it."""
    import mlflow

    if parent := os.environ.get("HISR_PARENT_RUN_ID"):
        return parent
    experiment_id = use_experiment(params)
    client = mlflow.MlflowClient()
    open_runs = client.search_runs(
        [experiment_id], f"tags.`{PIPELINE_TAG}` = 'true' and attributes.status = 'RUNNING'",
        order_by=["attributes.start_time DESC"], max_results=1)
    if open_runs:
        return open_runs[0].info.run_id
    if not create:
        return None
    run = client.create_run(experiment_id, tags={PIPELINE_TAG: "true"},
                            run_name=f"pipeline {time.strftime('%Y-%m-%d %H:%M:%S')}")
    client.log_dict(run.info.run_id, params.model_dump(mode="json"), "params.json")
    return run.info.run_id


def finish_pipeline_run(params: Params, status: str = "FINISHED") -> str | None:
    """End the parent run (see :func:`pipeline_run_id`), if one is open; returns its id."""
    import mlflow

    run_id = pipeline_run_id(params, create=False)
    if run_id is not None:
        mlflow.MlflowClient().set_terminated(run_id, status)
    return run_id


@contextlib.contextmanager
def stage_run(params: Params, stage: str, sections: Mapping[str, Any],
              tags: Mapping[str, str] | None = None, resume: str | None = None,
              reads: Sequence[Path] = (), writes: Sequence[Path] = ()) -> Iterator[Any]:
    """An MLflow run named ``stage``, a child of the pipeline's parent run, with ``sections``
    logged as params (and ``tags``), or the existing run ``resume`` continued (a stage
    restarted from its checkpoint). At the end, one line says what the stage read and wrote
    and how long it took (also logged as ``time/stage_s``).

    Without ``resume``, a run that a checkpoint of a fit writing under ``writes`` names (a stage
    stopped and restarted with the same params and ``reads``, by name, size and modification
    time: tag ``hisr.inputs``) is continued. A stage stopped by SIGTERM or SIGINT leaves its
    run KILLED, not FAILED."""
    import mlflow

    from hisr_core.train.preempt import Preempted
    from tasks.checkpoints import INPUTS_TAG, run_to_resume

    use_experiment(params)
    start = time.perf_counter()
    logged = {k: json.dumps(v) if not isinstance(v, str) else v
              for k, v in flatten(sections).items()}
    inputs = fingerprint(None, reads)
    if resume is None:
        resume = run_to_resume(writes, logged, inputs)
    if resume is not None:
        run_cm = mlflow.start_run(run_id=resume)
    else:
        run_cm = mlflow.start_run(run_name=stage, tags={
            "hisr.stage": stage, "mlflow.parentRunId": pipeline_run_id(params),
            INPUTS_TAG: inputs, **(tags or {})})
    with run_cm as run:
        if resume is None:
            mlflow.log_params(logged)
        try:
            yield run
        except Preempted:
            # Stopped, to be resumed: the restarted stage continues this very run.
            mlflow.end_run("KILLED")
            raise
        seconds = time.perf_counter() - start
        mlflow.log_metric("time/stage_s", seconds)
    print(f"stage {stage}: read {', '.join(map(str, reads)) or '-'}; "
          f"wrote {', '.join(map(str, writes)) or '-'}; {seconds:.1f} s")


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
    """An ``on_log`` callback for :func:`hisr_core.train.fit.fit` (and PPO's iterations): logs
    each step's metrics to the MLflow run ``run_id`` (if any) as metric histories, and keeps
    ``(step, loss)`` for a DVC plot.

    The pipeline's parent run gets them too, under ``<stage run name>/``: the experiment's
    chart view shows only the runs listed, and it lists a pipeline's stage runs folded under
    their parent, so without its own copy every chart section there reads "No charts in this
    section" until the parent is unfolded.

    In a run that goes on after a stop, the loss logged before is read back: the curve keeps
    the steps before the resume, and a step the resumed fit repeats (it had been logged after
    the last checkpoint) with the same loss is not logged twice."""

    def __init__(self, name: str, run_id: str | None) -> None:
        self.name, self.run_id = name, run_id
        self.logged: dict[int, float] = {}
        if run_id is not None:
            from mlflow import MlflowClient

            history = MlflowClient().get_metric_history(run_id, f"losses/{name}")
            self.logged = {m.step: m.value for m in history}
        self.curve: dict[int, float] = dict(self.logged)
        self._parent: tuple[str, str] | None = None

    @property
    def points(self) -> list[tuple[int, float]]:
        return sorted(self.curve.items())

    def _mirror(self) -> tuple[str, str] | None:
        """(parent run id, key prefix) of the run, if it has a parent; looked up once."""
        if self._parent is None:
            import mlflow

            run = mlflow.MlflowClient().get_run(self.run_id)
            parent = run.data.tags.get("mlflow.parentRunId")
            self._parent = (parent or "", f"{run.info.run_name}/")
        return self._parent if self._parent[0] else None

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        loss = metrics[f"losses/{self.name}"]
        self.curve[step] = loss
        if self.run_id is not None and self.logged.get(step) != loss:
            import mlflow

            mlflow.log_metrics(metrics, step=step, run_id=self.run_id)
            if mirror := self._mirror():
                parent, prefix = mirror
                mlflow.log_metrics({prefix + k: v for k, v in metrics.items()}, step=step,
                                   run_id=parent)

    def replay(self, path: Path) -> int:
        """Log the ``step,loss`` rows of ``path`` (written by :meth:`write_csv`) unless the run
        has this loss's history already: a stage whose training task came from Prefect's
        cache ran no steps in this run. Returns the points logged."""
        import csv

        import mlflow

        key = f"losses/{self.name}"
        if self.run_id is None or mlflow.MlflowClient().get_metric_history(self.run_id, key):
            return 0
        with Path(path).open(newline="") as f:
            rows = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]
        for step, loss in rows:
            self(step, {key: loss})
        return len(rows)

    def write_csv(self, path: Path) -> None:
        """``step,loss`` rows, written atomically."""
        write_csv(path, [("step", "loss"), *self.points])
