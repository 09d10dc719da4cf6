"""SIGTERM to a running ``sft`` stage (its real command line, real Prefect and MLflow): a clean
stop within the 30 s grace period, with a checkpoint, a KILLED MLflow run, one line saying how
to resume, and nothing left running (Prefect's temporary API server included); the same
command then resumes and continues that very MLflow run without repeating a step."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import ROOT, _clean_env

STEPS = 40  # the signal comes after 3 logged steps: it lands mid-training


@pytest.fixture(scope="module")
def expert_data(tmp_path_factory, run_module, mlflow_uri):
    tmp = tmp_path_factory.mktemp("expert")
    params = {"expert": {"n_train": 24, "n_valid_seen": 4, "n_valid_unseen": 4},
              "tracking": {"mlflow_uri": mlflow_uri, "experiment": "preempt-expert"}}
    (tmp / "params.yaml").write_text(yaml.safe_dump(params))
    proc = run_module("flows.expert", "--params", str(tmp / "params.yaml"),
                      "--data", str(tmp / "data"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp / "data"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ports(procs: list[psutil.Process]) -> set[int]:
    ports = set()
    for p in procs:
        try:
            ports |= {c.laddr.port for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    return ports


def _wait_for_steps(client, experiment: str, steps: int, proc: subprocess.Popen,
                    log: Path, timeout: float = 300) -> str:
    """The sft run's id once it has logged ``steps`` losses."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            for run in client.search_runs([exp.experiment_id], "attributes.run_name = 'sft'"):
                if len(client.get_metric_history(run.info.run_id, "losses/sft")) >= steps:
                    return run.info.run_id
        time.sleep(0.5)
    raise AssertionError("the sft stage logged no losses in time:\n" + log.read_text()[-3000:])


@pytest.mark.slow
def test_sigterm_stops_sft_cleanly_and_the_same_command_resumes(
        tmp_path, expert_data, run_module, mlflow_uri, experiment):
    import shutil

    from mlflow import MlflowClient

    data = tmp_path / "data"
    shutil.copytree(expert_data, data)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "env": {"max_turns": 8},
        "expert": {"n_train": 24, "n_valid_seen": 4, "n_valid_unseen": 4},
        "model": {"name_or_path": "builtin:tiny", "max_tokens": 1024},
        "sft": {"max_steps": STEPS, "epochs": 1000.0, "micro_batch_size": 4, "log_every": 1,
                "backend": "torch", "checkpoint_every_s": 3600.0},
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": experiment}}))
    # No PREFECT_API_URL: the stage starts its own temporary Prefect server, as a user's does.
    env = _clean_env()
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(tmp_path / "prefect"),
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "flows.sft", "--params", str(params), "--data", str(data)]
    log = tmp_path / "sft.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        client = MlflowClient(mlflow_uri)
        run_id = _wait_for_steps(client, experiment, 3, proc, log)
        parent = psutil.Process(proc.pid)
        children = parent.children(recursive=True)
        ports = _ports([parent, *children])
        assert children and ports, "the stage runs its temporary Prefect server"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the stage's process only, not its group
        status = proc.wait(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert status == 128 + signal.SIGTERM, text[-3000:]
    assert seconds < 30, f"stopped in {seconds:.1f} s"
    last = [line for line in text.splitlines() if line.strip()][-1]
    assert "sft: stopped by SIGTERM after step" in last, text[-3000:]
    assert "run the same command again to resume: python -m flows.sft --params" in last
    print(f"SIGTERM to exit: {seconds:.1f} s")

    # Nothing of the stage runs or listens any more.
    time.sleep(1)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [c.cmdline() for c in alive]
    assert not any(_listening(p) for p in ports)

    folder = data / "cache" / "checkpoints" / "sft" / "pi_ref"
    meta = json.loads((folder / "meta.json").read_text())
    assert 3 <= meta["step"] < STEPS and meta["run_id"] == run_id
    assert client.get_run(run_id).info.status == "KILLED"
    assert not (data / "sft" / "pi_ref").exists()

    proc = run_module("flows.sft", "--params", str(params), "--data", str(data))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from its checkpoint after step {meta['step']} of {STEPS}" in \
        proc.stdout + proc.stderr
    assert not folder.exists(), "the checkpoint goes once pi_ref is written"
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                              "attributes.run_name = 'sft'")
    assert [r.info.run_id for r in runs] == [run_id]  # the same run went on
    assert runs[0].info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run_id, "losses/sft")]
    assert sorted(steps) == list(range(1, STEPS + 1)), "each step logged once"
    curve = (data / "sft" / "loss.csv").read_text().splitlines()
    assert [int(row.split(",")[0]) for row in curve[1:]] == list(range(1, STEPS + 1))
    assert json.loads((data / "sft" / "metrics.json").read_text())["sft"]["resumed_from"] == \
        meta["step"]
    assert os.path.isdir(data / "sft" / "pi_ref")


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _describe(process: psutil.Process) -> list[str] | None:
    """A process's command line while it runs; ``None`` once it has ended (an orphan that
    exited is a zombie until its new parent reaps it)."""
    try:
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.cmdline()
    except psutil.NoSuchProcess:
        return None


def _sft_outs(repo: Path) -> dict[str, str]:
    """``path -> md5`` of the sft stage's outputs in ``dvc.lock``, but the metrics (they hold
    wall times)."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    outs = lock["stages"]["sft"]["outs"]
    return {o["path"]: o["md5"] for o in outs if not o["path"].endswith("metrics.json")}


@pytest.mark.slow
def test_sigterm_to_dvc_repro_then_repro_again_locks_what_an_uninterrupted_run_does(
        tmp_path, prefect_api):
    """SIGTERM to the process group of ``dvc repro sft`` (DVC, the stage and its temporary
    Prefect server, as a terminal's Ctrl-C or a batch system does): every process ends within
    30 s. Then ``dvc repro sft`` again: the stage resumes from its
    checkpoint and ``dvc.lock`` records the very ``pi_ref`` and loss curve of a ``dvc repro``
    never interrupted (in another copy of the repository)."""
    from tests.pipeline_copy import copy_repo, tiny_params

    steps = 40
    repos = {}
    for name in ("straight", "stopped"):
        params = tiny_params(f"sqlite:///{tmp_path / name}.db", ["ppo"], "preempt-dvc")
        params["sft"].update(max_steps=steps, epochs=1000.0)
        env = copy_repo(tmp_path / name, params, {**_clean_env(), **prefect_api})
        repos[name] = (tmp_path / name, env)

    repo, env = repos["straight"]
    proc = subprocess.run(["dvc", "repro", "sft"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    repo, env = repos["stopped"]
    proc = subprocess.run(["dvc", "repro", "expert"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # As `make repro` runs: the stage starts its own temporary Prefect server, in the group
    # the signal reaches, so the stage's last reports find it gone.
    own_server = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    own_server["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    log = tmp_path / "repro-stopped.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["dvc", "repro", "sft"], cwd=repo, env=own_server, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while f"| 3/{steps}" not in log.read_text():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "sft did not start training in time"
                time.sleep(0.2)
            group = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(True))]
            os.killpg(proc.pid, signal.SIGTERM)
            signalled = time.monotonic()
            proc.wait(timeout=30)
            # DVC itself dies at once; the stage takes its step and checkpoint first. All
            # within a scheduler's 30 s grace period.
            _, alive = psutil.wait_procs([p for p in map(_process, group) if p],
                                         timeout=30 - (time.monotonic() - signalled))
            running = [c for c in map(_describe, alive) if c is not None]
            assert not running, running
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode != 0
    assert (repo / "data" / "cache" / "checkpoints" / "sft" / "pi_ref" / "meta.json").is_file(), \
        log.read_text()[-3000:]
    proc = subprocess.run(["dvc", "repro", "sft"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "sft: resuming from its checkpoint after step" in proc.stdout + proc.stderr
    assert _sft_outs(repo) == _sft_outs(repos["straight"][0])
