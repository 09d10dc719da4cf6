"""The whole pipeline under ``dvc repro`` in a temporary copy of the repository, on a tiny
configuration (builtin:tiny, a few tasks, the ``hisr`` variant: the one that reads every
reward stage's output; the plain ``ppo`` variant runs in the serve and PPO stage tests), against the session's real Prefect
server and a real MLflow SQLite store: every stage is a completed flow run and a child MLflow
run with metrics, the report is written, a ``dvc repro`` killed during PPO resumes from the
PPO checkpoint without rerunning a finished stage, a second ``dvc repro`` runs nothing, and a
changed PPO param marks only the PPO stages as changed; ``dvc exp run -S
'sweep.seeds=[0,1]'`` adds the second seed's runs and a report over both seeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from tests.conftest import _clean_env
from tests.pipeline_copy import ROOT, copy_repo, tiny_params

pytestmark = pytest.mark.slow

VARIANTS = ["hisr"]
STAGES = {"expert", "sft", "evaluate_sft", "collect", "segment", "sprm", "hindsight", "rewards",
          "start_curve@0", *(f"ppo@{v}-0" for v in VARIANTS),
          *(f"evaluate@{v}-0" for v in VARIANTS), "report"}
FLOWS = {"expert", "sft", "evaluate", "collect", "segment", "sprm", "hindsight", "rewards",
         "start_curve", "ppo", "report"}


@pytest.fixture
def repo(tmp_path, prefect_api) -> tuple[Path, dict[str, str]]:
    """A copy of the repository with tiny params, and the environment its commands run in."""
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = copy_repo(tmp_path / "repo", tiny_params(mlflow_uri, VARIANTS, "pipeline-e2e"),
                    {**_clean_env(), **prefect_api})
    return tmp_path / "repo", {**env, "MLFLOW_URI": mlflow_uri}


def _dvc(repo: Path, env: dict[str, str], *args: str, timeout: float = 600) -> str:
    proc = subprocess.run(["dvc", *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _ran(output: str) -> set[str]:
    """Stages a ``dvc repro`` output says it ran."""
    return {line.split("'")[1] for line in output.splitlines()
            if line.startswith("Running stage '")}


def _kill_during_ppo(repo: Path, env: dict[str, str]) -> str:
    """Start ``dvc repro``; once PPO has checkpointed its first iteration, kill the whole
    process group (DVC and the stage) with SIGKILL. Returns what DVC printed."""
    log = repo.parent / "repro-killed.log"
    meta = repo / "data" / "cache" / "ppo" / VARIANTS[0] / "seed0" / "meta.json"
    with log.open("w") as out:
        proc = subprocess.Popen(["dvc", "repro"], cwd=repo, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while not meta.is_file():
            assert proc.poll() is None, "dvc repro ended before PPO checkpointed:\n" + \
                log.read_text()[-4000:]
            assert time.monotonic() < deadline, "no PPO checkpoint within 10 minutes"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    return log.read_text()


_READ_RUNS = """
import asyncio, json, sys
from datetime import datetime
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

async def read():
    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
            start_time=FlowRunFilterStartTime(after_=datetime.fromisoformat(sys.argv[1]))))
        flows = {f.id: f.name for f in await client.read_flows()}
        return [(flows[r.flow_id], r.state_type.value) for r in runs]

print(json.dumps(asyncio.run(read())))
"""


def _flow_runs_since(env: dict[str, str], since: datetime) -> list[tuple[str, str]]:
    """(flow name, state) of every flow run started on the server since ``since``, read in a
    process of its own pointed at the server."""
    proc = subprocess.run([sys.executable, "-c", _READ_RUNS, since.isoformat()], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]


def _without_venv(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this interpreter's folder taken off PATH: a shell that has not activated
    the virtual environment, where ``python`` is whatever else PATH finds."""
    venv_bin = Path(sys.executable).parent.resolve()
    path = [p for p in env["PATH"].split(os.pathsep) if p and Path(p).resolve() != venv_bin]
    return {**env, "PATH": os.pathsep.join(path)}


def test_stage_runs_without_venv_on_path(repo):
    """The README's ``.venv/bin/dvc repro``, from a shell that has not activated the venv: the
    stage commands find the project's interpreter themselves (scripts/python)."""
    copy, env = repo
    proc = subprocess.run([str(copy / ".venv" / "bin" / "dvc"), "repro", "expert"], cwd=copy,
                          env=_without_venv(env), capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert _ran(proc.stdout + proc.stderr) == {"expert"}
    assert "scripts/python -m flows.expert" in proc.stdout
    assert (copy / "data" / "expert" / "d_bc.parquet").stat().st_size > 0


def test_project_python_says_what_is_missing(tmp_path):
    """Without a .venv, HISR_PYTHON or a python3 that has the dependencies, scripts/python
    fails with a message that says how to get one, not Python's ModuleNotFoundError."""
    script = tmp_path / "scripts" / "python"
    script.parent.mkdir()
    script.write_bytes((ROOT / "scripts" / "python").read_bytes())
    script.chmod(0o755)
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = subprocess.run(["/bin/sh", str(script), "-c", "pass"], env={"PATH": str(empty)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 127
    assert "scripts/setup.sh" in proc.stderr and "HISR_PYTHON" in proc.stderr
    code = "import prefect, sys; print(sys.executable)"
    with_env = subprocess.run(["/bin/sh", str(script), "-c", code],
                              env={"PATH": str(empty), "HISR_PYTHON": sys.executable},
                              capture_output=True, text=True, timeout=120, check=False)
    assert with_env.returncode == 0, with_env.stderr
    assert with_env.stdout.strip() == sys.executable


def test_dvc_repro_end_to_end(repo):
    copy, env = repo
    since = datetime.now(UTC)
    killed = _kill_during_ppo(copy, env)
    before_kill = _ran(killed)
    assert {"expert", "sft", "collect", "rewards", f"ppo@{VARIANTS[0]}-0"} <= before_kill

    resumed = _dvc(copy, env, "repro")
    ran = _ran(resumed)
    finished = before_kill - {f"ppo@{VARIANTS[0]}-0"}
    assert not ran & finished, f"finished stages reran: {ran & finished}"
    assert ran | finished == STAGES
    assert "resumed after" in resumed, resumed[-3000:]

    report = (copy / "data" / "report" / "report.md").read_text()
    assert "## Success rate, valid_seen" in report
    assert "## Credit accuracy against the oracle" in report and "| credit | r_him |" in report
    assert "Spearman of `r_him` " in report and "`pi_hind`'s NLL minus `pi_ref`'s" in report
    assert "## Learning against the start (training draws)" in report
    assert (copy / "data" / "report" / "learning.png").stat().st_size > 1000
    assert all(f"| {p} |" in report for p in ["sft", *VARIANTS])
    assert (copy / "data" / "report" / "report.html").read_text().startswith("<!doctype html>")
    assert (copy / "data" / "report" / "curves.png").stat().st_size > 1000
    # Each evaluation keeps its per-task outcomes for git; the paired comparisons read them.
    for policy in ("sft", *(f"{v}/seed0" for v in VARIANTS)):
        lines = (copy / "data" / "eval" / policy / "outcomes.csv").read_text().splitlines()
        assert lines[0] == "split,task_id,won,score,n_turns" and len(lines) > 2, policy
    assert "## Paired comparisons, valid_seen" in report and "| vs sft |" in report
    assert "no correction for multiplicity" in report and "(1 of 1 seeds)" in report

    # Every stage a completed flow run on the Prefect server.
    runs = _flow_runs_since(env, since)
    completed = {name for name, state in runs if state == "COMPLETED"}
    assert FLOWS <= completed, f"no completed flow run for {FLOWS - completed}"

    # Every stage a child MLflow run with metrics, under one pipeline parent run.
    import mlflow

    mlflow.set_tracking_uri(env["MLFLOW_URI"])
    mruns = mlflow.search_runs(experiment_names=["pipeline-e2e"], output_format="list")
    parents = [r for r in mruns if r.data.tags.get("hisr.pipeline") == "true"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = {r.info.run_name: r for r in mruns if r not in parents}
    expected = {"expert", "sft", "evaluate/sft", "collect", "segment", "sprm", "hindsight",
                "rewards", "start_curve/seed0", *(f"ppo/{v}/seed0" for v in VARIANTS),
                *(f"evaluate/{v}/seed0" for v in VARIANTS), "report"}
    assert set(children) == expected
    for name, run in children.items():
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id, name
        assert run.data.metrics, f"{name} logged no metrics"
    assert children["evaluate/hisr/seed0"].data.tags["variant"] == "hisr"

    # Nothing to do the second time; a changed PPO param marks the PPO stages, and only them
    # (DVC reruns what follows a stage only if that stage's outputs change; the sweep below
    # runs such a selective rerun for real).
    assert _ran(_dvc(copy, env, "repro")) == set()
    params = yaml.safe_load((copy / "params.yaml").read_text())
    params["ppo"]["lr"] = 2 * params["ppo"]["lr"]
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = json.loads(next(line for line in _dvc(copy, env, "status", "--json").splitlines()
                             if line.startswith("{")))
    assert set(status) == {f"ppo@{v}-0" for v in VARIANTS}, status
    assert all({"changed deps": {"params.yaml": {"ppo": "modified"}}} in status[f"ppo@{v}-0"]
               for v in VARIANTS), status
    params["ppo"]["lr"] /= 2
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    # The README's seed sweep: a second seed adds its runs and reruns nothing else.
    swept = _dvc(copy, env, "exp", "run", "-S", "sweep.seeds=[0,1]")
    assert _ran(swept) == {"start_curve@1", *(f"ppo@{v}-1" for v in VARIANTS),
                           *(f"evaluate@{v}-1" for v in VARIANTS), "report"}
    report = (copy / "data" / "report" / "report.md").read_text()
    assert all(f"| {v} |" in report and report.split(f"| {v} |")[1].split("\n")[0]
               .rstrip().endswith("| 2 |") for v in VARIANTS), report
    assert "(2 of 2 seeds)" in report  # the tests in words pair both seeds with sft
