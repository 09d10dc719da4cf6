"""MLflow plumbing: the pipeline's parent run (one per pipeline run, continued after a crash,
finished by the report) and the tracking URI override, on a real SQLite store."""

from __future__ import annotations

import mlflow

from hisr_core.config import parse_params
from tasks.tracking import finish_pipeline_run, pipeline_run_id, stage_run


def test_parent_run_is_reused_until_finished(mlflow_uri, experiment, monkeypatch):
    monkeypatch.delenv("HISR_PARENT_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = parse_params({"tracking": {"mlflow_uri": mlflow_uri, "experiment": experiment}})
    first = pipeline_run_id(params)
    assert pipeline_run_id(params) == first, "an unfinished parent is continued"
    with stage_run(params, "expert", {"expert": {"seed": 0}}) as run:
        mlflow.log_metric("m", 1.0)
    child = mlflow.get_run(run.info.run_id)
    assert child.data.tags["mlflow.parentRunId"] == first
    assert "time/stage_s" in child.data.metrics
    assert finish_pipeline_run(params) == first
    assert mlflow.get_run(first).info.status == "FINISHED"
    assert finish_pipeline_run(params) is None
    second = pipeline_run_id(params)
    assert second != first
    monkeypatch.setenv("HISR_PARENT_RUN_ID", "given")
    assert pipeline_run_id(params) == "given"


def test_tracking_uri_variable_wins(tmp_path, experiment, monkeypatch):
    monkeypatch.delenv("HISR_PARENT_RUN_ID", raising=False)
    store = f"sqlite:///{tmp_path / 'other.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    params = parse_params({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'params.db'}",
                                        "experiment": experiment}})
    with stage_run(params, "sft", {}):
        pass
    assert mlflow.get_tracking_uri() == store
    assert (tmp_path / "other.db").is_file() and not (tmp_path / "params.db").exists()
