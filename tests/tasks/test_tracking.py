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


def test_a_restarted_stage_continues_its_run_only_with_the_same_inputs(mlflow_uri, experiment,
                                                                       tmp_path, monkeypatch):
    """A stage stopped mid-fit leaves a KILLED run that its checkpoint names. Restarted on the
    same params and inputs it continues that run; on other inputs (the fit then discards the
    checkpoint and starts from step 1) it starts a new run, so no step is logged twice."""
    import json

    import pytest

    from hisr_core.train.checkpoint import META
    from hisr_core.train.preempt import Preempted
    from tasks.caching import use_cache_dir
    from tasks.checkpoints import folder_for

    monkeypatch.delenv("HISR_PARENT_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    params = parse_params({"tracking": {"mlflow_uri": mlflow_uri, "experiment": experiment}})
    data = tmp_path / "data"
    use_cache_dir(data / "cache" / "prefect")
    d_bc, out = data / "expert" / "d_bc.parquet", data / "sft" / "pi_ref"
    d_bc.parent.mkdir(parents=True)
    d_bc.write_bytes(b"first")
    sections = {"sft": {"lr": 1e-3}}

    def start() -> str:
        with stage_run(params, "sft", sections, reads=[d_bc], writes=[out]) as run:
            return run.info.run_id

    with (pytest.raises(Preempted),
          stage_run(params, "sft", sections, reads=[d_bc], writes=[out]) as run):
        stopped = run.info.run_id
        folder = folder_for(out)
        folder.mkdir(parents=True)
        (folder / META).write_text(json.dumps({"run_id": stopped, "step": 3}))
        raise Preempted(15)
    assert mlflow.get_run(stopped).info.status == "KILLED"

    d_bc.write_bytes(b"other inputs")
    assert start() != stopped, "other inputs: a new run"
    d_bc.write_bytes(b"firsT")
    assert start() != stopped, "same size, other bytes: other inputs"
    d_bc.write_bytes(b"first")  # the same bytes written anew, as a DVC run-cache restore does
    assert start() == stopped, "the same inputs: the stopped run goes on"
    assert mlflow.get_run(stopped).info.status == "FINISHED"
