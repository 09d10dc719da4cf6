"""``flows.serve``: every stage flow served as a deployment on the session's real Prefect
server; the ``pipeline`` deployment, started through the API (as the UI's Run button does)
with its parameters edited, runs every stage in one process on a tiny configuration, each
a child MLflow run of one parent run, and writes the report."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import ROOT, _clean_env, stop
from tests.pipeline_copy import tiny_params

pytestmark = pytest.mark.slow

#: Deployment names (each named like its flow: ``expert/expert`` and so on).
DEPLOYMENTS = {"expert", "sft", "collect", "segment", "sprm", "hindsight", "rewards",
               "start_curve", "ppo", "evaluate", "report", "pipeline"}


def _prefect(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_serve_registers_every_stage_and_runs_the_pipeline(prefect_api, tmp_path):
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(mlflow_uri, ["ppo"], "served")))
    data = tmp_path / "data"
    env = {**_clean_env(), **prefect_api, "PYTHONPATH": str(ROOT)}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "flows.serve", "--params", str(params),
                               "--data", str(tmp_path / "unused")], cwd=ROOT, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            listed = _prefect(env, "--no-prompt", "deployment", "ls", "--output", "json")
            names = ({d["name"] for d in json.loads(listed.stdout or "[]")}
                     if listed.returncode == 0 else set())
            if DEPLOYMENTS <= names:
                break
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"deployments missing: {DEPLOYMENTS - names}"
            time.sleep(2)
        # The parameters as edited in the UI: another data folder than the served default.
        run = _prefect(env, "deployment", "run", "pipeline/pipeline", "-p", f"data={data}",
                       "--watch", "--watch-timeout", "600", timeout=660)
        assert run.returncode == 0, (tmp_path / "serve.log").read_text()[-4000:]
        assert "Completed" in run.stdout + run.stderr
    finally:
        stop(server)
        log.close()
    report = (data / "report" / "report.md").read_text()
    success = report.split("## Success rate, valid_seen")[1].split("\n## ")[0].splitlines()
    assert sum(line.startswith("| ppo |") for line in success) == 1  # one seed's row

    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    runs = mlflow.search_runs(experiment_names=["served"], output_format="list")
    parents = [r for r in runs if r.data.tags.get("hisr.pipeline") == "true"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = {r.info.run_name for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert children == {"expert", "sft", "evaluate/sft", "collect", "segment", "sprm",
                        "hindsight", "rewards", "start_curve/seed0", "ppo/ppo/seed0",
                        "evaluate/ppo/seed0", "report"}
