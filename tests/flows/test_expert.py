"""The ``expert`` stage end to end (real Prefect ephemeral server, real MLflow sqlite store)."""

from __future__ import annotations

import json

import pytest

from hisr_core import contracts
from hisr_core.config import load_params
from tasks.expert import expert_play, make_tasks


@pytest.mark.slow
def test_expert_flow_writes_contracted_outputs_and_mlflow_run(run_module, write_params, tmp_path,
                                                             mlflow_uri, experiment):
    data, params = tmp_path / "data", write_params()
    proc = run_module("flows.expert", "--params", str(params), "--data", str(data))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The flow run is named after the stage (and the params file and data folder, which are
    # not the defaults here), not Prefect's random adjective-animal.
    assert f"Beginning flow run 'expert [params={params}, data={data}]'" in \
        proc.stdout + proc.stderr
    for split, n in [("train", 24), ("valid_seen", 12), ("valid_unseen", 12)]:
        rows = contracts.read_rows(data / "tasks" / f"{split}.parquet", "tasks")
        assert len(rows) == n and {r["split"] for r in rows} == {split}
    d_bc = contracts.read_rows(data / "expert" / "d_bc.parquet", "expert_trajectories")
    assert len(d_bc) == 24 and all(r["won"] and r["n_turns"] == len(r["turns"]) for r in d_bc)
    metrics = json.loads((data / "expert" / "metrics.json").read_text())
    assert metrics["expert"]["train"]["success_rate"] == 1.0
    assert sum(metrics["tasks"]["train"]["task_types"].values()) == 24

    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    runs = mlflow.search_runs(experiment_names=[experiment], output_format="list",
                              filter_string="tags.`hisr.stage` = 'expert'")
    assert [r.info.run_name for r in runs] == ["expert"]
    assert runs[0].data.metrics["expert/train/success_rate"] == 1.0
    assert runs[0].data.params["expert.n_train"] == "24"


BAD_PARAMS = [
    ({"expert": {"n_trian": 5}}, "unknown key 'expert.n_trian'; did you mean 'expert.n_train'?"),
    ({"exprt": {"seed": 1}}, "unknown key 'exprt'; did you mean 'expert'?"),
    ({"expert": {"n_train": -5}}, "expert.n_train: Input should be greater than or equal to 1"),
    ({"env": {"max_turns": "many"}}, "env.max_turns: Input should be a valid integer"),
    ({"env": {"name": "kitchen"}}, "unknown environment 'kitchen'"),
    ({"env": {"options": {"show_admisible": True}}}, "show_admisible"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_PARAMS)
def test_bad_params_exit_nonzero_naming_key_and_write_nothing(
        run_module, write_params, tmp_path, overrides, message, mlflow_uri, experiment):
    data = tmp_path / "data"
    proc = run_module("flows.expert", "--params", str(write_params(overrides)), "--data", str(data))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not data.exists()
    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    assert mlflow.get_experiment_by_name(experiment) is None, "no MLflow run may be started"


def test_missing_params_file(run_module, tmp_path):
    proc = run_module("flows.expert", "--params", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "nope.yaml: cannot read parameters file" in proc.stderr


def _run_stage_in_process(params_file, data, workers=0):
    """The stage's tasks without the Prefect engine (``.fn``), for byte comparisons."""
    p = load_params(params_file)
    path = data / "tasks" / "train.parquet"
    make_tasks.fn(p.env, "train", p.expert.n_train, p.expert.seed, path)
    expert_play.fn(p.env, path, data / "d_bc.parquet", p.expert.slip_rate, workers)
    return path.read_bytes(), (data / "d_bc.parquet").read_bytes()


def test_same_seed_gives_byte_identical_d_bc(write_params, tmp_path):
    params = write_params({"expert": {"n_train": 60}})
    a = _run_stage_in_process(params, tmp_path / "a")
    b = _run_stage_in_process(params, tmp_path / "b")
    assert a == b
    c = _run_stage_in_process(write_params({"expert": {"n_train": 60, "seed": 1}}), tmp_path / "c")
    assert c[1] != a[1]


def test_worker_processes_give_the_same_d_bc(write_params, tmp_path, monkeypatch):
    # expert.workers plays the games in pools of processes replaced every few games (3 here,
    # so 10 games take two pools); the order and every byte must match the in-process play.
    import hisr_core.envs.workers

    monkeypatch.setattr(hisr_core.envs.workers, "GAMES_PER_PROCESS", 3)
    params = write_params({"expert": {"n_train": 10, "slip_rate": 0.3}})
    assert _run_stage_in_process(params, tmp_path / "a", workers=2) == \
        _run_stage_in_process(params, tmp_path / "b")
