"""A stage's frame (tasks/stage.py) on a real SQLite MLflow store: the params it logs, inputs
that must exist, per-step metric histories on the stage run and its pipeline's parent run
(replayed when training came from the cache), and a model folder as a logged model that
loads."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow.entities import LoggedModelStatus

from hisr_core.agent.models import build_builtin, load_model
from hisr_core.config import parse_params
from tasks.logged_models import run_models
from tasks.stage import pick, run_stage
from tasks.tracking import LossCurve


@pytest.fixture
def params_file(tmp_path, mlflow_uri, experiment, monkeypatch) -> Path:
    monkeypatch.delenv("HISR_PARENT_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"tracking": {"mlflow_uri": mlflow_uri,
                                                 "experiment": experiment}}))
    return path


def _history(run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in mlflow.MlflowClient().get_metric_history(run_id, key)]


def test_pick_takes_sections_and_fields():
    params = parse_params({})
    picked = pick(params, ["env.name", "hindsight.past", "hindsight.future", "rewards"])
    assert picked == {"env": {"name": params.env.name},
                      "hindsight": {"past": params.hindsight.past,
                                    "future": params.hindsight.future},
                      "rewards": params.rewards.model_dump()}


def test_missing_input_names_the_stage_that_makes_it(params_file, tmp_path):
    missing = tmp_path / "data" / "d_ct.parquet"
    with (pytest.raises(SystemExit, match=r"d_ct.parquet does not exist; run the collect stage"),
          run_stage("segment", params_file, tmp_path / "data", ["segment"],
                    needs={missing: "collect"})):
        pytest.fail("the stage ran without its input")


def test_step_metrics_reach_the_parent_run_and_are_replayed_from_the_cache(params_file,
                                                                            tmp_path):
    data = tmp_path / "data"
    with run_stage("sft", params_file, data, ["env.name", "sft"]) as stage:
        curve = LossCurve("sft", stage.run_id)
        for step in (1, 2, 3):
            curve(step, {"losses/sft": 1.0 / step, "perf/tokens_per_s": 10.0 * step})
        curve.write_csv(tmp_path / "loss.csv")
    run = mlflow.get_run(stage.run_id)
    assert run.data.params["sft.lr"] == str(stage.params.sft.lr)
    assert run.data.params["env.name"] == stage.params.env.name
    parent = run.data.tags["mlflow.parentRunId"]
    assert _history(stage.run_id, "losses/sft") == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    # The parent run, the one row the experiment's chart view lists, charts the stage too.
    assert _history(parent, "sft/losses/sft") == _history(stage.run_id, "losses/sft")
    assert [s for s, _ in _history(parent, "sft/perf/tokens_per_s")] == [1, 2, 3]

    # A rerun whose training task is a cache hit logs no steps: the CSV fills the history in,
    # once (a run that has it already is left alone).
    with run_stage("sft", params_file, data, ["sft"]) as again:
        again.log_curve("sft", tmp_path / "loss.csv")
        again.log_curve("sft", tmp_path / "loss.csv")
    assert again.run_id != stage.run_id
    assert _history(again.run_id, "losses/sft") == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [a.path for a in mlflow.MlflowClient().list_artifacts(again.run_id)] == ["loss.csv"]


def test_model_folder_is_one_logged_model_that_loads(params_file, tmp_path):
    folder = build_builtin("builtin:tiny", ["go to the fridge", "open the drawer 1"] * 20, 0,
                           tmp_path / "pi_ref")
    with run_stage("sft", params_file, tmp_path / "data", ["sft"]) as stage:
        uri = stage.log_model(folder, "pi_ref", "policy")
        assert stage.log_model(folder, "pi_ref", "policy") == uri, "the same folder twice"
    models = run_models(stage.run_id)
    assert list(models) == ["pi_ref"] and uri == f"models:/{models['pi_ref'].model_id}"
    assert models["pi_ref"].tags["hisr.stage"] == "sft"
    assert models["pi_ref"].status == LoggedModelStatus.READY
    # The weights are in the logged model only, once: none among the run's own artifacts.
    assert mlflow.MlflowClient().list_artifacts(stage.run_id) == []
    loaded = mlflow.pyfunc.load_model(uri)
    [text] = loaded.predict(["go to the"], params={"max_new_tokens": 3})
    assert isinstance(text, str) and text
    weights = loaded.unwrap_python_model().model.state_dict()
    saved = load_model(folder).state_dict()
    assert saved.keys() == weights.keys() and all(saved[k].equal(weights[k]) for k in saved)
    with (pytest.raises(ValueError, match="not a model folder"),
          run_stage("sft", params_file, tmp_path / "data", ["sft"]) as stage):
        stage.log_model(tmp_path, "nothing", "policy")
