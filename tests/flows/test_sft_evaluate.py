"""``sft`` then ``evaluate`` end to end through their command lines (real Prefect, MLflow)."""

from __future__ import annotations

import json

import pytest

from hisr_core import contracts
from tasks.sft import corpus
from tests.hf_fixtures import save_tiny_qwen
from tests.params_files import write_overlay


@pytest.fixture(scope="module")
def expert_data(tmp_path_factory, run_module, mlflow_uri):
    """One small expert run shared by the tests of this module."""
    tmp = tmp_path_factory.mktemp("expert")
    params = write_overlay(tmp / "params.yaml", {
        "expert": {"n_train": 24, "n_valid_seen": 6, "n_valid_unseen": 6},
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": "sft-evaluate-expert"}})
    proc = run_module("flows.expert", "--params", str(params), "--data", str(tmp / "data"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp / "data"


def _params(mlflow_uri, experiment, model, **sft):
    return {
        "env": {"max_turns": 8},
        "expert": {"n_train": 24, "n_valid_seen": 6, "n_valid_unseen": 6},
        "model": {"name_or_path": model, "max_tokens": 1024},
        "sft": {"max_steps": 3, "micro_batch_size": 4, "log_every": 1, "backend": "torch", **sft},
        "evaluate": {"n_tasks": 4},
        "rollout": {"batch_size": 4, "max_new_tokens": 24},
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": experiment},
    }


def _run_sft_and_evaluate(run_module, tmp_path, expert_data, model, mlflow_uri, experiment):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(expert_data, data)
    params = write_overlay(tmp_path / "params.yaml", _params(mlflow_uri, experiment, model))
    proc = run_module("flows.sft", "--params", str(params), "--data", str(data))
    assert proc.returncode == 0, proc.stderr[-3000:]
    pi_ref = data / "sft" / "pi_ref"
    assert (pi_ref / "config.json").is_file()
    metrics = json.loads((data / "sft" / "metrics.json").read_text())["sft"]
    assert metrics["steps"] == 3 and metrics["loss"] > 0
    assert (data / "sft" / "loss.csv").read_text().startswith("step,loss\n1,")

    proc = run_module("flows.evaluate", "--model", str(pi_ref), "--name", "sft",
                      "--params", str(params), "--data", str(data))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| sft | valid_seen |" in proc.stdout + proc.stderr
    for split in ("valid_seen", "valid_unseen"):
        rows = contracts.read_rows(data / "eval" / "sft" / "episodes" / f"{split}.parquet",
                                   "episodes")
        assert len(rows) == 4 and all(r["n_turns"] == len(r["turns"]) >= 1 for r in rows)
    ev = json.loads((data / "eval" / "sft" / "metrics.json").read_text())["eval"]
    assert set(ev["valid_seen"]["success"]) == {"PICK", "CLEAN", "HEAT", "COOL", "LOOK",
                                                "PICK2", "all"}

    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    runs = {r.info.run_name: r for r in
            mlflow.search_runs(experiment_names=[experiment], output_format="list")}
    parents = [r for r in runs.values() if r.data.tags.get("hisr.pipeline") == "true"]
    assert len(parents) == 1, "both stages nest under one open pipeline run"
    assert set(runs) == {"sft", "evaluate/sft", parents[0].info.run_name}
    assert {runs[s].data.tags["mlflow.parentRunId"] for s in ("sft", "evaluate/sft")} == {
        parents[0].info.run_id}
    client = mlflow.MlflowClient()
    history = client.get_metric_history(runs["sft"].info.run_id, "losses/sft")
    assert [m.step for m in history] == [1, 2, 3]
    assert "eval/valid_seen/success/all" in runs["evaluate/sft"].data.metrics
    # pi_ref is the run's logged model (its only copy in MLflow), READY, and it loads with the
    # folder's weights and generates.
    from mlflow.entities import LoggedModelStatus

    from hisr_core.agent.models import load_model
    from tasks.logged_models import run_models

    model = run_models(runs["sft"].info.run_id)["pi_ref"]
    assert model.status == LoggedModelStatus.READY and model.tags["hisr.kind"] == "policy"
    assert not any(a.path == "pi_ref" for a in client.list_artifacts(runs["sft"].info.run_id))
    loaded = mlflow.pyfunc.load_model(f"models:/{model.model_id}")
    [text] = loaded.predict(["You are in the middle of a room."], params={"max_new_tokens": 4})
    assert isinstance(text, str)
    saved = load_model(pi_ref).state_dict()
    weights = loaded.unwrap_python_model().model.state_dict()
    assert saved.keys() == weights.keys() and all(saved[k].equal(weights[k]) for k in saved)


@pytest.mark.slow
def test_builtin_model_through_sft_and_evaluate(run_module, tmp_path, expert_data, mlflow_uri,
                                                experiment):
    _run_sft_and_evaluate(run_module, tmp_path, expert_data, "builtin:tiny", mlflow_uri,
                          experiment)


@pytest.mark.slow
def test_hf_model_folder_through_sft_and_evaluate(run_module, tmp_path, expert_data, mlflow_uri,
                                                  experiment):
    folder = save_tiny_qwen(tmp_path / "qwen",
                            corpus(expert_data / "expert" / "d_bc.parquet", "household"), 600)
    _run_sft_and_evaluate(run_module, tmp_path, expert_data, str(folder), mlflow_uri, experiment)


def test_missing_model_folder_fails_at_start(run_module, write_params, tmp_path):
    params = write_params({"model": {"name_or_path": str(tmp_path / "no_model")}})
    proc = run_module("flows.sft", "--params", str(params), "--data", str(tmp_path / "data"))
    assert proc.returncode == 2
    assert f"model.name_or_path '{tmp_path / 'no_model'}': no such folder" in proc.stderr
    proc = run_module("flows.evaluate", "--model", str(tmp_path / "no_model"), "--name", "x",
                      "--params", str(params), "--data", str(tmp_path / "data"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert not (tmp_path / "data").exists()
